"""The engine session of a multi-rank engine (TP, EP, DCP over processes; ranks.py starts them).

Rank 0's ``RankSession`` is the EngineSession the step loop sees. Each call that runs the model
(prefill, verify, and the MTP drafter's forward: the MTP layer is sharded too) or touches the
caches (copy_kda, rollback_kda) sends one plan (the method and the step's host Batch) and then runs
the same call on rank 0's shard; each worker runs it on its own (``RankWorker``). The model
gathers the logits, so they are complete on rank 0, which alone samples.

What differs per rank, derived from the same plan on every rank:
  KDA      a rank holds linear_attn_config.num_heads / tp heads per slot (``local_cfg``)
  MLA      under DCP a rank stores 1/dcp of each sequence's tokens (parallel/cache.py). The
           scheduler's logical block holds ``page · dcp`` tokens, and a rank keeps its share of
           logical block b in its own page b (page = the block_size option, rank-local), so the
           one block table serves every rank; only the slot mapping is per rank (``local_batch``).
           Needs dcp_interleave to divide the page.
  weights  ``rank_weights_dir``: where rank r reads its shard

Per-request state (blocks, KDA slots, drafter and grammar state) lives on rank 0 only, so a
request that ends there (finished, aborted, failed, preempted) is ended on every rank; a worker
that raises inside a step stops the engine (ranks.py), since the step's collectives are shared.
A plan is checked on rank 0 before it goes out: an error before sending ends only that step's
requests.

Drafters: ngram and draft:DIR run on rank 0 alone; mtp runs the target's sharded MTP layer on
every rank (``RankMTPDrafter``); layerskip is refused. Lookahead decoding (runtime/lookahead.py)
is off: it needs a GraphSession on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from k3trt.config import ModelConfig
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.engine.engine_dir import EngineDir, read_engine_dir
from k3trt.model.context import ModelCache
from k3trt.model.loader import load_model
from k3trt.parallel.cache import dcp_slot_mapping
from k3trt.parallel.comm import TorchComm
from k3trt.parallel.config import ParallelConfig
from k3trt.runtime.engine import Batch, EngineSession, TorchSession
from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.kv_cache import CachePlan
from k3trt.runtime.ranks import RankGroup, run_worker
from k3trt.runtime.speculative import make_drafter
from k3trt.runtime.speculative.draft_model import SeqStep, step_context
from k3trt.runtime.speculative.mtp import MTPDrafter, mtp_forward

log = logging.getLogger(__name__)


def rank_weights_dir(ed: EngineDir, rank: int) -> Path:
    """The directory rank `rank` loads its weights from: its own rank dir in an engine built split
    (``k3trt build --tp/--dcp/--ep``: only its slices), else the whole checkpoint in rank0/, which
    the sharded loader reads only this rank's slices of."""
    return ed.rank_path(rank) if ed.world_size > 1 else ed.rank_dir


def parallel_config(ed: EngineDir | None, *, tp: int | None, dcp: int | None, ep: int | None,
                    dcp_interleave: int | None) -> ParallelConfig | None:
    """The layout to run (EngineDir.layout: a split engine dir's own, else the options'); None for
    one process."""
    asked = dict(tp=tp, dcp=dcp, ep=ep, dcp_interleave=dcp_interleave)
    if ed is None:
        pc = ParallelConfig(**{k: v for k, v in asked.items() if v is not None})
    else:
        built = ed.layout(**asked)
        pc = ParallelConfig(built.tp, built.dcp, built.ep, built.dcp_interleave)
    return pc if pc.world_size > 1 else None


def local_cfg(cfg: ModelConfig, pc: ParallelConfig) -> ModelConfig:
    """`cfg` as one rank's caches see it: its share of the KDA heads."""
    la = cfg.linear_attn_config
    return dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(la, num_heads=la.num_heads // pc.tp))


def local_batch(batch: Batch, pc: ParallelConfig, page: int) -> Batch:
    """The batch as rank pc.rank runs it: under DCP its own slot mapping (-1: another rank's token)."""
    if pc.dcp == 1:
        return batch
    return dataclasses.replace(batch, slot_mapping=dcp_slot_mapping(batch.ctx_lens, batch.q_lens, batch.block_table,
                                                                    page, pc))


def check_dcp_page(pc: ParallelConfig, page: int) -> None:
    if page % pc.dcp_interleave:
        raise ValueError(f"dcp_interleave {pc.dcp_interleave} does not divide the rank's cache page of {page} "
                         f"tokens (block_size): pick an interleave that divides it")


@dataclass(frozen=True)
class SessionSpec:
    """What every rank needs to open its local session (rank 0 decides, the plan carries it)."""
    cfg: ModelConfig
    plan: CachePlan                  # the scheduler's: blocks of page · dcp tokens
    verify: tuple[int, ...]          # verify capacities (graph captures)
    k: int                           # drafts per request
    graphs: bool
    build: BuildConfig
    max_model_len: int


def open_local(model: torch.nn.Module, pc: ParallelConfig, spec: SessionSpec, device: torch.device) -> TorchSession:
    """This rank's eager or graph session over its shard; the same on every rank."""
    b, k = spec.build, spec.k
    plan = dataclasses.replace(spec.plan, block_size=spec.plan.block_size // pc.dcp)
    kw = dict(device=device, dtype=b.torch_dtype, kv_dtype=b.kv_torch_dtype, kv_scale=b.kv_scale,
              max_q=k + 1 if k else 0)
    cfg = local_cfg(spec.cfg, pc)
    if spec.graphs:      # every rank captures the same graphs in the same order: their collectives pair up
        return GraphSession(model, cfg, plan, capacities=spec.verify, q_values=(1, k + 1) if k else (1,),
                            max_blocks=-(-spec.max_model_len // spec.plan.block_size), **kw)
    return TorchSession(model, cfg, plan, **kw)


class MTPShard:
    """A rank's MTP layer cache and forward (the drafter's decisions stay on rank 0)."""

    def __init__(self, model: torch.nn.Module, pc: ParallelConfig, *, num_blocks: int, block_size: int,
                 device: torch.device):
        cfg, self.model, self.pc, self.device = model.cfg, model, pc, device
        self.block_size, self.page = block_size, block_size // pc.dcp
        idx = cfg.num_hidden_layers
        self.cache = ModelCache.allocate(cfg, num_blocks=num_blocks, block_size=self.page, num_slots=1,
                                         dtype=next(model.parameters()).dtype, device=device,
                                         layers=range(idx, idx + 1))

    def step(self, steps: list[SeqStep], prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, ctx = step_context(steps, self.block_size, self.device)
        if self.pc.dcp > 1:
            slots = dcp_slot_mapping(ctx.ctx_lens, ctx.q_lens, ctx.block_table.cpu(), self.page, self.pc)
            ctx = dataclasses.replace(ctx, slot_mapping=slots.to(self.device))
        with torch.inference_mode():
            return mtp_forward(self.model, self.cache, ids, ctx, prev)


class RankMTPDrafter(MTPDrafter):
    """MTPDrafter whose forward runs on every rank (rank 0 decides, as MTPDrafter does)."""

    def __init__(self, session: "RankSession", model: torch.nn.Module, *, k: int, max_live: int,
                 max_model_len: int, block_size: int, sample_drafts: bool = False,
                 draft_vocab_size: int | None = None, **_: Any):
        if draft_vocab_size is not None:     # mtp_forward's head is the full one, gathered over TP ranks
            raise ValueError("draft_vocab_size: a multi-rank engine's MTP drafter scores the full vocabulary; "
                             "drop --draft-vocab (draft_vocab_size), or run one rank")
        k_max = k
        self.group = session.group
        nb = max_live * -(-(max_model_len + k_max) // block_size)
        with self.group.guard("opening the MTP drafter"):
            self.group.send("mtp_open", (nb, block_size))
            self.shard = MTPShard(model, self.group.pc, num_blocks=nb, block_size=block_size, device=session.device)
        super().__init__(model, model.cfg, k_max=k_max, max_live=max_live, max_model_len=max_model_len,
                         block_size=block_size, num_blocks=nb, sample_drafts=sample_drafts, cache=self.shard.cache,
                         graphs=False)   # its steps go to every rank (_step), never through one rank's graphs

    def _step(self, steps: list[SeqStep], prev: torch.Tensor, embeds=None) -> tuple[torch.Tensor, torch.Tensor]:
        # `embeds` (image rows of a prompt) are not sent to the ranks: the MTP layer reads the token
        # embedding there, which only lowers acceptance on image prompts; verification decides
        steps = [SeqStep(list(s.tokens), s.ctx_len, list(s.blocks), s.slot) for s in steps]
        self.eager_steps += 1
        with self.group.guard("MTP draft step"):
            self.group.send("mtp_step", (steps,), [prev])
            out = self.shard.step(steps, prev)
            self.group.settle("MTP draft step")
            return out


class RankSession(EngineSession):
    """Rank 0's session: each call goes to every rank as one plan, then runs here (module doc)."""

    def __init__(self, group: RankGroup, model: torch.nn.Module, spec: SessionSpec, device: torch.device):
        self.group, self.model, self.cfg, self.plan = group, model, spec.cfg, spec.plan
        self.device, self.page = torch.device(device), spec.plan.block_size // group.pc.dcp
        check_dcp_page(group.pc, self.page)
        with group.guard("opening the rank sessions"):
            group.send("open", (spec,))
            group.ready()
            self.local = open_local(model, group.pc, spec, self.device)

    @property
    def hidden(self) -> torch.Tensor | None:
        return self.local.hidden

    @property
    def graph_stats(self):
        return getattr(self.local, "graph_stats", {})

    def prefill(self, batch: Batch) -> torch.Tensor:
        mine = local_batch(batch, self.group.pc, self.page)
        with self.group.guard("prefill step"):
            self.group.send("prefill", (batch,))
            out = self.local.prefill(mine)
            self.group.settle("prefill step")
            return out

    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        mine = local_batch(batch, self.group.pc, self.page)
        with self.group.guard("verify step"):
            self.group.send("verify", (batch,), [] if device_ids is None else [device_ids])
            out = self.local.verify(mine, device_ids)
            self.group.settle("verify step")     # a graph replay's collectives have no watchdog
            return out

    def copy_kda(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            with self.group.guard("KDA slot copy"):
                self.group.send("copy_kda", (list(pairs),))
                self.local.copy_kda(pairs)

    def rollback_kda(self, slots: list[int], positions: list[int]) -> None:
        if slots:
            with self.group.guard("KDA rollback"):
                self.group.send("rollback_kda", (list(slots), list(positions)))
                self.local.rollback_kda(slots, positions)

    def make_drafter(self, spec: str, **kw: Any):
        """make_drafter for this engine: mtp sharded over the ranks, layerskip refused."""
        if spec == "mtp":
            return RankMTPDrafter(self, self.model, **kw)
        if spec.startswith("layerskip:"):
            raise ValueError(f"--speculative {spec} runs the target's first layers as a separate model, which a "
                             "multi-rank engine does not do: use mtp, ngram or draft:DIR")
        return make_drafter(spec, **kw)

    def health(self) -> dict[str, Any]:
        return self.group.health()

    def close(self) -> None:
        self.group.close()


class RankWorker:
    """A worker rank's side of the plans: the same calls on its own shard and caches."""

    def __init__(self, group: RankGroup, model: torch.nn.Module):
        self.group, self.model, self.pc, self.device = group, model, group.pc, group.device
        self.session: TorchSession | None = None
        self.mtp: MTPShard | None = None
        self.page = 0
        self.calls: dict[str, Callable[..., Any]] = {
            "open": self.open, "prefill": self.prefill, "verify": self.verify, "copy_kda": self.copy_kda,
            "rollback_kda": self.rollback_kda, "mtp_open": self.mtp_open, "mtp_step": self.mtp_step}

    def run(self, method: str, args: tuple, tensors: list[torch.Tensor]) -> None:
        call = self.calls.get(method)
        if call is None:
            raise ValueError(f"rank {self.pc.rank}: unknown plan {method!r} (rank 0 runs another k3trt version?)")
        call(*args, *tensors)

    def open(self, spec: SessionSpec) -> None:
        self.page = spec.plan.block_size // self.pc.dcp
        self.group.ready()
        self.session = open_local(self.model, self.pc, spec, self.device)

    def prefill(self, batch: Batch) -> None:
        self.session.prefill(local_batch(batch, self.pc, self.page))

    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None) -> None:
        self.session.verify(local_batch(batch, self.pc, self.page), device_ids)

    def copy_kda(self, pairs: list[tuple[int, int]]) -> None:
        self.session.copy_kda(pairs)

    def rollback_kda(self, slots: list[int], positions: list[int]) -> None:
        self.session.rollback_kda(slots, positions)

    def mtp_open(self, num_blocks: int, block_size: int) -> None:
        self.mtp = MTPShard(self.model, self.pc, num_blocks=num_blocks, block_size=block_size, device=self.device)

    def mtp_step(self, steps: list[SeqStep], prev: torch.Tensor) -> None:
        self.mtp.step(steps, prev)


def load_rank_model(ed: EngineDir, group: RankGroup) -> torch.nn.Module:
    """This rank's shard of the model; building its communicator is collective (every rank, in order)."""
    comm = TorchComm(group.pc, timeout=timedelta(seconds=group.timeout_s))
    return load_model(rank_weights_dir(ed, group.rank), dtype=ed.build.torch_dtype, device=group.device,
                      comm=comm)[1]


def serve_rank(group: RankGroup, ed: EngineDir, rank_init: Callable[[int], None] | None,
               verify_checksums: bool = True) -> None:
    """A worker rank's life: load its shard, then run rank 0's plans until the shutdown plan.
    `rank_init(rank)` runs once the shard is loaded (logging setup, test instrumentation). In an
    engine built split, the worker verifies its own rank dir's checksums when `verify_checksums`
    (EngineOptions.verify_checksums; rank 0 verified the rest)."""
    if verify_checksums and ed.world_size > 1 and group.rank > 0:
        ed = read_engine_dir(ed.path, rank=group.rank)
    model = load_rank_model(ed, group)
    if rank_init is not None:
        rank_init(group.rank)
    worker = RankWorker(group, model)
    log.info("rank %d of %d ready on %s", group.rank, group.world_size, group.device)
    while True:
        method, args, tensors = group.receive()
        if method == "shutdown":
            return
        worker.run(method, args, tensors)



def start_ranks(ed: EngineDir, pc: ParallelConfig, device: torch.device, *, timeout_s: float,
                rank_init: Callable[[int], None] | None,
                verify_checksums: bool = True) -> tuple[RankGroup, torch.nn.Module]:
    """Rank 0's group (workers spawned here, or joined under torchrun) and its shard of the model.
    Under torchrun every rank runs the same command: on ranks > 0 this serves rank 0's plans and
    ends the process (SystemExit 0) when rank 0 closes the engine. `verify_checksums`: each worker
    verifies its own rank dir (serve_rank)."""
    args = (ed, rank_init, verify_checksums)
    if ed.backend != "torch":
        raise ValueError(f"{ed.path} is a {ed.backend} engine dir; multi-rank engines run the torch backend "
                         "(`k3trt build CHECKPOINT --backend torch --tp ...`)")
    pc.validate(ed.model)
    check_dcp_page(pc, ed.build.block_size)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        group = RankGroup.join(pc, device=device, timeout_s=timeout_s)
        if group.rank != 0:
            run_worker(group, serve_rank, args)
            raise SystemExit(0)
    else:
        group = RankGroup.start(pc, serve_rank, args, device=device, timeout_s=timeout_s)
    try:
        return group, load_rank_model(ed, group)
    except BaseException as e:
        group.fail(f"loading rank 0's shard: {type(e).__name__}: {e}")
        group.close()
        raise


def open_rank_session(group: RankGroup, model: torch.nn.Module, *, cfg: ModelConfig, plan: CachePlan,
                      run_caps: Capacities, k: int, graphs: bool, build: BuildConfig, max_model_len: int,
                      **_: Any) -> RankSession:
    """LLM._setup's session opener for a multi-rank engine (the keywords of llm.SESSIONS)."""
    spec = SessionSpec(cfg, plan, tuple(run_caps.verify), k, graphs, build, max_model_len)
    return RankSession(group, model, spec, group.device)
