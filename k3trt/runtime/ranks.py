"""The processes of a multi-rank engine: rank 0 is the caller's process (scheduler, tokenizer,
grammars, drafter decisions, sampling); ranks 1.. are workers that run every session call on their
shard of the model (rank_session.py says which calls).

    group = RankGroup.start(pc, target, args, device="cuda", timeout_s=300)  # spawns world-1 workers
    group = RankGroup.join(pc, device="cuda", timeout_s=300)  # torchrun: rank $RANK of $WORLD_SIZE
    group.send(method, args, tensors)              # rank 0: one plan to every worker
    method, args, tensors = group.receive()        # a worker: the next plan
    with group.guard("verify"): ...                # rank 0: any fault in here is a RankFailure
    group.health(); group.close()

Three channels:
  control  a gloo group with no practical timeout: the plans (method name + pickled host tensors,
           broadcast by rank 0); a worker waits here while the engine is idle
  data     the default group (NCCL on CUDA, gloo on CPU) with timeout ``timeout_s``: the model's
           collectives (TorchComm's groups get the same timeout) and a plan's device tensors, so
           a rank that dies or hangs inside a step fails every other rank's collective within it
  store    the rendezvous TCPStore: a worker that fails writes its error there before it exits,
           and rank 0 names that rank and its error in the RankFailure

A fault (a worker that exits or raises, a collective past its timeout, an error on rank 0 after a
plan went out) leaves the ranks out of step, so the engine stops: rank 0 raises RankFailure for
the call and for every call after it, ends the workers (spawned ones are terminated, then killed),
and ``health()`` reports it. Spawned workers also exit when their parent process is gone.

On CUDA, rank 0 waits for each step on the host inside its guard (``settle``): collectives
replayed from a CUDA graph are outside NCCL's watchdog, so a peer that died mid-step would leave
rank 0's kernels waiting forever. A worker found dead, or a step past ``timeout_s``, aborts the
communicators (the waiting kernels return) and stops the engine before any of the step's outputs
are used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3trt.parallel.config import ParallelConfig
from k3trt.parallel.launch import MULTICAST_OFF

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)     # an idle engine keeps its workers waiting on the control group
START_TIMEOUT = timedelta(minutes=30)     # every rank's process up (imports, CUDA init) and in the store
ERROR_KEY = "k3trt/rank_error/{}"
JOIN_SECONDS = 10.0                       # a worker's clean exit after shutdown, before it is terminated
REPORT_SECONDS = 2.0                      # how long rank 0 waits for a failed worker's error report
SETTLE_POLL_S = 1e-4                      # rank 0's poll of a CUDA step's completion, for its first
SETTLE_WATCH_S = 0.01                     # seconds; then every SETTLE_WATCH_POLL_S, each poll also
SETTLE_WATCH_POLL_S = 1e-3                # looking for a dead worker


class RankFailure(RuntimeError):
    """A multi-rank engine stopped: a rank died, hung past rank_timeout_s, or failed inside a step.
    The message names the rank and the cause; the engine must be restarted."""


class RankGroup:
    """This process's place in a multi-rank engine (module doc). Rank 0 holds the worker processes
    when it spawned them (``procs``); under torchrun the launcher owns them."""

    def __init__(self, pc: ParallelConfig, store: dist.Store, device: torch.device, timeout_s: float,
                 procs: Sequence[Any] = ()):
        self.pc, self.store, self.device, self.timeout_s = pc, store, device, timeout_s
        self.procs = list(procs)                      # rank r is procs[r - 1] (spawned only)
        self.error: str | None = None
        self.closed = False
        # plans are pickled objects; their broadcast needs a CPU group whatever the data backend
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    @property
    def rank(self) -> int:
        return self.pc.rank

    @property
    def world_size(self) -> int:
        return self.pc.world_size

    # ------------------------------------------------------------------------------ starting
    @classmethod
    def start(cls, pc: ParallelConfig, target: Callable, args: tuple, *, device: torch.device | str,
              timeout_s: float) -> "RankGroup":
        """Rank 0 in this process; ranks 1..world-1 spawned, each running ``target(group, *args)``
        (importable) once its process group is up. Returns rank 0's group."""
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            check_gpus(pc, torch.cuda.device_count())
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: start a multi-rank "
                               "engine in a fresh process, or under torchrun (every rank runs the same command)")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, pc.world_size, True, timeout=START_TIMEOUT, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs = []
        try:
            for r in range(1, pc.world_size):
                p = ctx.Process(target=_worker_entry, name=f"k3trt-rank{r}", daemon=True,
                                args=(pc.with_rank(r), store.port, device, timeout_s, os.getpid(), target, args))
                p.start()
                procs.append(p)
            _init(pc, store, device, timeout)
            return cls(pc, store, device, timeout_s, procs)
        except BaseException:
            _end_processes(procs)
            raise

    @classmethod
    def join(cls, pc: ParallelConfig, *, device: torch.device | str, timeout_s: float) -> "RankGroup":
        """This process as rank $RANK of a torchrun world ($WORLD_SIZE, $MASTER_ADDR, $MASTER_PORT),
        on GPU $LOCAL_RANK of its node when `device` is a CUDA device, else on the CPU (gloo)."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != pc.world_size:
            raise ValueError(f"torchrun started {world} ranks; tp={pc.tp} dcp={pc.dcp} ep={pc.ep} needs "
                             f"{pc.world_size} (--nproc-per-node × --nnodes must equal it)")
        if torch.device(device).type == "cuda":
            local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
            if local >= count:
                raise ValueError(f"torchrun LOCAL_RANK {local}: this node sees {count} GPU(s) (CUDA_VISIBLE_DEVICES); "
                                 f"start at most {count} processes per node (--nproc-per-node), one per GPU")
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        pc = pc.with_rank(rank)
        timeout = timedelta(seconds=timeout_s)
        # the agent's store when torchrun hosts one (its default), else rank 0 hosts it (as env:// does)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              rank == 0 and not agent, timeout=START_TIMEOUT)
        _init(pc, store, device, timeout)
        return cls(pc, store, device, timeout_s)

    # ------------------------------------------------------------------------------ plans
    def send(self, method: str, args: tuple = (), tensors: Sequence[torch.Tensor] = ()) -> None:
        """Rank 0: one plan to every worker: `method` and `args` (pickled, host tensors) over the
        control group, then `tensors` (on this rank's device) over the data group."""
        msg = [(method, args, [(tuple(t.shape), t.dtype) for t in tensors])]
        dist.broadcast_object_list(msg, src=0, group=self.control)
        for t in tensors:
            dist.broadcast(t.contiguous(), src=0)

    def receive(self) -> tuple[str, tuple, list[torch.Tensor]]:
        """A worker: the next plan (blocks while the engine is idle)."""
        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=0, group=self.control)
        method, args, specs = msg[0]
        tensors = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(t, src=0)
            tensors.append(t)
        return method, args, tensors

    # ------------------------------------------------------------------------------ faults
    @contextlib.contextmanager
    def guard(self, what: str):
        """Rank 0 around a plan and its local run: any exception in it stops the engine (the workers
        are past the plan and may wait in a collective) and comes out as RankFailure."""
        self.check()
        try:
            yield
        except RankFailure:
            raise
        except Exception as e:
            raise self.fail(f"{what}: {type(e).__name__}: {e}") from e

    def settle(self, what: str) -> None:
        """Rank 0 inside a guard, after launching a step on CUDA: wait for it, watching the workers
        (module doc). gloo's collectives need none: they raise when a peer is gone or at their timeout."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.wait_for(done.query, what)

    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        """Poll `done` until true; a dead worker or `timeout_s` passed aborts the collectives and
        stops the engine (RankFailure). Checked once more after `done`: a step that a watchdog
        abort ended has no valid outputs."""
        t0 = time.monotonic()
        while not done():
            if time.monotonic() - t0 > SETTLE_WATCH_S:
                self._watch(what, t0)
                time.sleep(SETTLE_WATCH_POLL_S)
            else:
                time.sleep(SETTLE_POLL_S)
        self._watch(what, t0)

    def _watch(self, what: str, t0: float) -> None:
        waited = time.monotonic() - t0
        dead = any(not p.is_alive() for p in self.procs)
        if dead or waited > self.timeout_s:
            abort_collectives()
            raise self.fail(f"{what}: waited {waited:.1f}s for the step on the device")

    def check(self) -> None:
        """Raise RankFailure if the engine stopped or a spawned worker has exited."""
        if self.error is None:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if dead:
                self.fail("rank {} exited with code {}".format(*dead[0]))
        if self.error is not None:
            raise RankFailure(self.error)

    def fail(self, what: str) -> RankFailure:
        """Stop the engine (once): name the failed rank from the workers' reports, end the workers."""
        if self.error is None:
            reports = self._reports()
            if reports:
                cause = "; ".join(f"rank {r} failed: {text}" for r, text in reports)
            else:
                dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.procs, 1)
                        if not p.is_alive()]
                cause = "; ".join(dead) or (f"{what} (no rank reported an error: a rank hung or is slower than "
                                            f"rank_timeout_s={self.timeout_s:g})")
            self.error = (f"multi-rank engine stopped ({self.world_size} ranks): {cause}. Every in-flight request "
                          "ends with this error; restart the engine, and see that rank's log")
            log.error("%s (rank 0 saw: %s)", self.error, what)
            _end_processes(self.procs, grace=0.0)
        return RankFailure(self.error)

    def _reports(self) -> list[tuple[int, str]]:
        """(rank, error) from the store; waits briefly for a worker that is still on its way out."""
        keys = [ERROR_KEY.format(r) for r in range(1, self.world_size)]
        deadline = time.monotonic() + REPORT_SECONDS
        while True:
            try:
                found = [(r, self.store.get(k).decode()) for r, k in enumerate(keys, 1) if self.store.check([k])]
            except Exception:          # the store went with a failed rank (torchrun): no reports
                return []
            alive = any(p.is_alive() for p in self.procs)
            if found or not alive or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def report(self, error: str) -> None:
        """A worker: leave `error` for rank 0 (before this process exits)."""
        with contextlib.suppress(Exception):
            self.store.set(ERROR_KEY.format(self.rank), error)

    def health(self) -> dict[str, Any]:
        """{"ok": bool, "ranks": [{"rank", "alive", "exitcode"}], "error": str | None}; alive is None
        where this process does not hold the rank (torchrun)."""
        if self.error is None and not self.closed:
            with contextlib.suppress(RankFailure):
                self.check()
        ranks = [{"rank": 0, "alive": True, "exitcode": None}]
        for r in range(1, self.world_size):
            p = self.procs[r - 1] if self.procs else None
            ranks.append({"rank": r, "alive": None if p is None else p.is_alive(),
                          "exitcode": None if p is None else p.exitcode})
        error = self.error or ("the engine is closed" if self.closed else None)
        return {"ok": error is None, "ranks": ranks, "error": error}

    # ------------------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Rank 0: every worker leaves its loop and exits (or is ended), the process group goes."""
        if self.closed:
            return
        self.closed = True
        if self.error is None:
            try:
                self.send("shutdown")
                dist.barrier()
            except Exception as e:
                log.warning("multi-rank shutdown: %s: %s; ending the workers", type(e).__name__, e)
        _end_processes(self.procs, grace=JOIN_SECONDS if self.error is None else 0.0)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def ready(self) -> None:
        """Every rank, before the first collective of the model: waits (on the control group, without
        the step timeout) for the ranks still loading their shards."""
        dist.barrier(group=self.control)

    def leave(self) -> None:
        """A worker after the shutdown plan: the barrier rank 0 waits on, then the process group."""
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def check_gpus(pc: ParallelConfig, count: int) -> None:
    """Spawned CUDA ranks take one GPU each (NCCL refuses two ranks of a communicator on one GPU)."""
    if pc.world_size > count:
        raise ValueError(f"tp={pc.tp} dcp={pc.dcp} ep={pc.ep} runs {pc.world_size} ranks, one GPU each, and this "
                         f"process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES): use a layout of at most {count} "
                         "ranks, or run the ranks across nodes with torchrun")


def _init(pc: ParallelConfig, store: dist.Store, device: torch.device, timeout: timedelta) -> None:
    """The process group, once every rank is in the store: its connections are made within
    `timeout`, which rank_timeout_s may make shorter than a worker's start."""
    if store.add("k3trt/arrived", 1) == pc.world_size:
        store.set("k3trt/all_arrived", "1")
    store.wait(["k3trt/all_arrived"])
    cuda = device.type == "cuda"
    if cuda:
        os.environ.update(MULTICAST_OFF)           # before NCCL starts (launch.py says why)
        # a collective past its timeout aborts the communicators and raises in this process, rather
        # than the default of ending the process (rank 0 is the server: it reports and stays up)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("k3trt/pg", store),
                            rank=pc.rank, world_size=pc.world_size, timeout=timeout,
                            **({"device_id": device} if cuda else {}))


def abort_collectives() -> None:
    """Abort every communicator of this process (NCCL: ncclCommAbort, so that kernels waiting for a
    gone peer return); the process group is gone afterwards."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as e:          # already aborted by the watchdog, or destroyed
        log.warning("aborting the collectives: %s: %s", type(e).__name__, e)


def _end_processes(procs: Sequence[Any], grace: float = JOIN_SECONDS) -> None:
    """Join each worker for up to `grace` seconds, then terminate, then kill: none outlives this."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _watch_parent(parent: int) -> None:
    """A spawned worker ends itself when rank 0's process is gone (no orphan holds a GPU)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="k3trt-parent-watch", daemon=True).start()


def _worker_entry(pc: ParallelConfig, port: int, first: torch.device, timeout_s: float, parent: int,
                  target: Callable, args: tuple) -> None:
    """A spawned worker's process: join the group, run `target` until the shutdown plan. Rank r
    takes the r-th GPU after rank 0's."""
    _watch_parent(parent)
    timeout = timedelta(seconds=timeout_s)
    device = torch.device("cuda", (first.index + pc.rank) % torch.cuda.device_count()) if first.type == "cuda" \
        else first
    store = dist.TCPStore("127.0.0.1", port, pc.world_size, False, timeout=START_TIMEOUT)
    _init(pc, store, device, timeout)
    group = RankGroup(pc, store, device, timeout_s)
    run_worker(group, target, args)


def run_worker(group: RankGroup, target: Callable, args: tuple) -> None:
    """Run ``target(group, *args)``; on an exception report it to rank 0 and end the process at once
    (its peers' collectives then fail fast instead of waiting for the timeout)."""
    try:
        target(group, *args)
    except BaseException as e:
        text = f"{type(e).__name__}: {e}"
        log.error("rank %d failed: %s\n%s", group.rank, text, traceback.format_exc())
        group.report(text)
        os._exit(1)
    group.leave()
