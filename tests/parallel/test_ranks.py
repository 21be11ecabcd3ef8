"""The multi-rank runtime on CPU (gloo): ``LLM`` over 2 and 4 processes gives one process's greedy
tokens, with n-gram and MTP speculation, a JSON schema, a request arriving mid-flight, a
cancellation and forced preemption; faults (a killed rank, a rank raising inside a step, a hung
collective) end the engine with RankFailure within a bounded time and leave no process behind.

The engine is the runtime tests' tiny torch engine (4 MLA heads, 2 KDA heads, 8 experts, one MTP
layer, fp32). Rank 0 holds every per-request resource (blocks, slots, drafter state); workers
hold only fixed-size caches, so rank 0's leak check plus every worker's clean exit covers all ranks.
"""

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from runtime_utils import assert_released, prompts

from k3trt.engine.engine_dir import read_engine_dir
from k3trt.parallel import ParallelConfig
from k3trt.runtime.engine import Seq, TorchSession, make_batch
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.rank_session import RankMTPDrafter, local_batch, parallel_config
from k3trt.runtime.ranks import RankFailure, RankGroup, check_gpus
from k3trt.runtime.request import FinishReason

MAX_MODEL_LEN = 64
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# (prompt length, max_tokens, guided). The cache holds one max_model_len request (4 blocks of 16
# tokens, or 64 / (16·dcp) blocks of 16·dcp). The first request needs a block past position 32
# by step 7 (one token a step at least). Under DCP (two blocks) the guided request takes the other
# block at step 3, when the cancelled one leaves, and needs 4 steps more (3 tokens a step at most),
# so it is preempted whatever the drafts; blocks of 16 have more requests holding them. drive()
# compiles the schema first, so that admission does not depend on the compile thread's timing
REQUESTS = [(26, 10, False), (7, 12, False), (11, 12, True), (19, 6, False)]
LATE = (17, 6)               # arrives after the first steps
CANCEL_AT = 3                # the cancelled request (the second) ends after this many steps

LAYOUTS = {       # name -> (layout, engine options)
    "tp2": (dict(tp=2), {}),
    "dcp2-ngram": (dict(dcp=2), dict(speculative="ngram")),
    "tp2dcp2ep2-mtp": (dict(tp=2, dcp=2, ep=2, dcp_interleave=2), dict(speculative="mtp")),
    "tp2ep2-mtp": (dict(tp=2, ep=2), dict(speculative="mtp")),
    # GraphSession's padded static steps (uncaptured on CPU), with every rank's collectives inside
    "tp2dcp2ep2-static": (dict(tp=2, dcp=2, ep=2), dict(cuda_graphs=True)),
    "ep2-mtp": (dict(ep=2), dict(speculative="mtp")),
    "tp2dcp2ep4-ngram": (dict(tp=2, dcp=2, ep=4), dict(speculative="ngram")),     # 4 ranks
}
SLOW = {"tp2ep2-mtp", "ep2-mtp", "tp2dcp2ep4-ngram"}     # CI time: MTP and EP run inside the combined layouts


def params(max_tokens, guided):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=not guided,
                          guided={"json_schema": SCHEMA} if guided else None)


def workload():
    ids = prompts(5, [n for n, _, _ in REQUESTS] + [LATE[0]], vocab=2000)
    return ids[:-1], ids[-1]


@pytest.fixture(scope="module")
def reference(engine):
    """One process, plain greedy through generate: token ids per request (and the late one)."""
    ids, late = workload()
    llm = LLM(engine, verify_checksums=False, max_model_len=MAX_MODEL_LEN)
    outs = llm.generate(ids + [late], [params(m, g) for _, m, g in REQUESTS] + [params(LATE[1], False)])
    llm.close()
    return [o.token_ids for o in outs]


def drive(llm):
    """The scenario through add_request / step: every request, one late, one cancelled."""
    ids, late = workload()
    llm.compile_guided(params(1, True).guided).result()
    rids = [llm.add_request(p, params(m, g)) for p, (_, m, g) in zip(ids, REQUESTS)]
    final, steps = {}, 0
    while llm.has_unfinished() or steps == 0:
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == 2:
            rids.append(llm.add_request(late, params(LATE[1], False)))
        if steps == CANCEL_AT:
            llm.abort(rids[1])
    for out in llm.step():          # the abort's snapshot, if it came after the last step
        final[out.request_id] = out
    return [final[r] for r in rids]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_ranks_give_one_process_greedy_tokens(engine, reference, name):
    layout, opts = LAYOUTS[name]
    spec = opts.get("speculative", "none")
    pc = ParallelConfig(**layout)
    blocks = MAX_MODEL_LEN // (16 * pc.dcp)
    llm = LLM(engine, verify_checksums=False, max_model_len=MAX_MODEL_LEN, num_blocks=blocks,
              spec_tokens=2 if spec != "none" else None, **opts, **layout)
    try:
        outs = drive(llm)
        for i, out in enumerate(outs):
            want = reference[i] if i < len(REQUESTS) else reference[-1]
            if i == 1:
                assert out.finish_reason == FinishReason.ABORT
                assert out.token_ids == want[:len(out.token_ids)], name
            else:
                assert out.finish_reason != FinishReason.ERROR, out.error
                assert out.token_ids == want, (name, i)
        assert llm.counters["preemptions"] > 0, "the cache was meant to force a preemption"
        if spec == "mtp":       # verify steps with drafts and KDA rollbacks ran on every rank (random
            assert llm.stats()["speculative"]["drafted_tokens"] > 0     # weights: n-gram finds none)
        if "cuda_graphs" in opts:
            assert llm.stats()["graphs"].get("static", 0) > 0
        assert_released(llm)
        assert llm.health()["ok"]
    finally:
        llm.close()
    health = llm.health()
    assert [r["exitcode"] for r in health["ranks"][1:]] == [0] * (pc.world_size - 1), health


# ---------------------------------------------------------------------------------- faults
def _raise_in_third_verify(rank):
    """rank_init for the fault tests: rank 1's third verify call raises."""
    _patch_verify(rank, lambda: (_ for _ in ()).throw(RuntimeError("injected fault")))


def _hang_in_third_verify(rank):
    _patch_verify(rank, lambda: time.sleep(3600))


def _patch_verify(rank, fault):
    if rank != 1:
        return
    calls, verify = [0], TorchSession.verify

    def patched(self, batch, device_ids=None):
        calls[0] += 1
        if calls[0] == 3:
            fault()
        return verify(self, batch, device_ids)
    TorchSession.verify = patched


def _start_two(engine, **kw):
    llm = LLM(engine, verify_checksums=False, max_model_len=MAX_MODEL_LEN, ep=2, **kw)
    ids, _ = workload()
    for p in ids[:2]:
        llm.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    return llm


def _expect_failure(llm, match, within):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=match):
        for _ in range(50):
            llm.step()
    took = time.monotonic() - t0
    assert took < within, f"RankFailure after {took:.1f}s"
    assert not llm.has_unfinished()
    ended = llm.step()                       # the requests' final snapshots: each failed with the error
    assert ended and all(o.finish_reason == FinishReason.ERROR and "rank" in o.error for o in ended)
    health = llm.health()
    assert not health["ok"] and health["error"]
    with pytest.raises(RankFailure):
        llm.add_request([1, 2, 3])
    llm.close()
    assert not any(r["alive"] for r in llm.health()["ranks"][1:])


def test_killed_rank_stops_the_engine(engine):
    llm = _start_two(engine)
    llm.step()
    os.kill(llm.session.group.procs[0].pid, signal.SIGKILL)
    _expect_failure(llm, "rank 1 exited with code -9", within=20)


def test_rank_raising_in_a_step_stops_the_engine(engine):
    llm = _start_two(engine, rank_init=_raise_in_third_verify)
    _expect_failure(llm, "rank 1 failed: RuntimeError: injected fault", within=20)


def test_hung_collective_times_out(engine):
    llm = _start_two(engine, rank_init=_hang_in_third_verify, rank_timeout_s=4)
    _expect_failure(llm, "hung or is slower than rank_timeout_s=4", within=20)


def _fail_at_start(rank):
    raise RuntimeError(f"rank {rank} cannot start")


def test_rank_failing_at_start_fails_the_constructor(engine):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed: RuntimeError: rank 1 cannot start"):
        LLM(engine, verify_checksums=False, max_model_len=MAX_MODEL_LEN, tp=2, rank_init=_fail_at_start)
    assert time.monotonic() - t0 < 60
    assert not multiprocessing.active_children()      # the worker that did start is gone too


# ---------------------------------------------------------------------------------- units
def test_parallel_config_from_options(engine):
    ed = read_engine_dir(engine, verify_checksums=False)
    assert parallel_config(ed, tp=None, dcp=None, ep=None, dcp_interleave=None) is None
    assert parallel_config(ed, tp=1, dcp=None, ep=None, dcp_interleave=None) is None
    assert parallel_config(ed, tp=2, dcp=None, ep=4, dcp_interleave=None) == ParallelConfig(tp=2, ep=4)


@pytest.mark.parametrize("D,I", [(2, 1), (2, 4), (4, 2)])
def test_dcp_pages_share_the_logical_block_table(D, I):
    """A logical block of page·D tokens puts each rank's share of it in that rank's page of the same
    number: every token lands once, in its rank's page of its logical block."""
    page = 16
    seqs = [Seq(list(range(70)), 0, [5, 2, 7], 0, 1), Seq([1] * 9, 40, [3, 0], 1, 1)]
    batch = make_batch(seqs, page * D, capacity=64)
    hits = torch.zeros(batch.num_tokens, dtype=torch.long)
    pos = torch.cat([torch.arange(s.ctx_len, s.ctx_len + len(s.tokens)) for s in seqs])
    table = batch.block_table[torch.repeat_interleave(torch.arange(2), torch.tensor(batch.q_lens))]
    for r in range(D):
        slots = local_batch(batch, ParallelConfig(dcp=D, dcp_interleave=I, rank=r), page).slot_mapping
        mine = slots >= 0
        hits += mine
        logical = pos[mine] // (page * D)
        assert torch.equal(slots[mine] // page, table[mine, logical].long())
    assert torch.equal(hits, torch.ones_like(hits))


TORCHRUN_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from k3trt.runtime.llm import LLM
llm = LLM(sys.argv[1], verify_checksums=False, tp=2, max_model_len=64)
outs = llm.generate([[5, 6, 7, 8, 9]], {"max_tokens": 5, "ignore_eos": True})
print("TOKENS", outs[0].token_ids, llm.health()["ok"])
llm.close()
"""


@pytest.mark.slow
def test_torchrun_world_serves_rank_zero(engine, tmp_path):
    """Every rank runs the same command under torchrun: ranks > 0 serve rank 0 and exit 0."""
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                          str(engine)], capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    one = LLM(engine, verify_checksums=False, max_model_len=64)
    want = one.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    one.close()
    assert f"TOKENS {want} True" in got.stdout


ORPHAN_SCRIPT = """
import sys, time, torch
from k3trt.runtime.llm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], verify_checksums=False, tp=2, max_model_len=64)
    print("PIDS", *[p.pid for p in llm.session.group.procs], flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_workers_exit_when_rank_zero_is_killed(engine, tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script), str(engine)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        workers = [int(p) for p in line.split()[1:]]
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), "a worker outlived rank 0"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:           # a zombie has exited
        return f.read().split()[2] != "Z"


def test_parallel_config_of_an_engine_dir_wins(engine):
    ed = read_engine_dir(engine, verify_checksums=False)

    Built = dataclasses.replace(ed, parallel=ParallelConfig(tp=2, ep=2))     # as a split engine dir records it
    assert parallel_config(Built, tp=None, dcp=None, ep=None, dcp_interleave=None) == ParallelConfig(tp=2, ep=2)
    assert parallel_config(Built, tp=2, dcp=None, ep=None, dcp_interleave=None) == ParallelConfig(tp=2, ep=2)
    with pytest.raises(ValueError, match="was built for"):
        parallel_config(Built, tp=1, dcp=None, ep=None, dcp_interleave=None)


def test_rank_mtp_refuses_a_draft_vocabulary():
    """Its draft head is the full one, gathered over TP ranks: a reduced vocabulary is an error, not ignored."""
    with pytest.raises(ValueError, match="draft_vocab_size: a multi-rank engine"):
        RankMTPDrafter(None, None, k=2, max_live=1, max_model_len=64, block_size=16, draft_vocab_size=100)


def test_spawned_cuda_ranks_need_a_gpu_each():
    check_gpus(ParallelConfig(tp=2, ep=2), 2)
    with pytest.raises(ValueError, match="runs 2 ranks, one GPU each, and this process sees 1 GPU"):
        check_gpus(ParallelConfig(tp=2, dcp=2), 1)


def test_torchrun_rank_on_cuda_needs_its_local_gpu(monkeypatch):
    """A CUDA engine under torchrun takes GPU $LOCAL_RANK; one the node lacks is refused before any
    process group starts (a CPU engine stays on gloo whatever the node has)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(ValueError, match="this node sees .* GPU"):
        RankGroup.join(ParallelConfig(tp=2), device="cuda", timeout_s=5)


class _Proc:
    """A spawned worker as RankGroup sees it."""

    def __init__(self, alive=True):
        self.alive, self.exitcode = alive, None if alive else -9

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        pass

    def terminate(self):
        self.alive, self.exitcode = False, -15

    kill = terminate


def _group(procs, timeout_s):
    group = RankGroup.__new__(RankGroup)      # no process group: wait_for's watch alone
    group.pc, group.store, group.device, group.timeout_s = ParallelConfig(tp=3), None, torch.device("cpu"), timeout_s
    group.procs, group.error, group.closed = procs, None, False
    return group


@pytest.mark.parametrize("case", ["dead", "late"])
def test_a_step_waiting_on_the_device_stops_on_a_dead_or_late_rank(monkeypatch, case):
    """A CUDA step whose collectives wait for a gone peer (a graph replay has no watchdog) never
    completes: rank 0's wait aborts the collectives and stops the engine naming the cause."""
    aborted = []
    monkeypatch.setattr("k3trt.runtime.ranks.abort_collectives", lambda: aborted.append(True))
    group = _group([_Proc(), _Proc()], timeout_s=0.3)
    group.wait_for(lambda: True, "verify step")               # done at once, every rank alive: nothing
    assert not aborted and group.error is None
    if case == "dead":
        group.procs[1] = _Proc(alive=False)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 2 exited with code -9" if case == "dead" else "hung or is slower"):
        group.wait_for(lambda: False, "verify step")
    assert aborted and time.monotonic() - t0 < 5
    with pytest.raises(RankFailure):
        group.check()
