"""Static decode / verify steps: one CUDA graph per (batch capacity, rows per request).

A decode step (Q = 1) and a verification step with K drafts each (Q = K + 1) have one shape per
batch capacity once the batch is padded to it, so each (capacity, Q) is captured once and replayed
with new inputs. Everything a replay reads lives in one packed int64 buffer on the device
(``Layout``): one host-to-device copy per step, and the graph itself turns the views into the
step's tensors, so no length of any one step is baked into a graph. Padding sequences see no
tokens (length 0), write no cache row (slot -1), and run their KDA recurrence on a spare slot that
no request owns.

A verification step whose requests bring fewer drafts than the graph's Q - 1 (cut by max_tokens,
a grammar, or an n-gram drafter that found fewer) pads each request's rows at its end (see
``Layout.pack``) and then restores those requests' KDA state to their last real row. Prefill
chunks, and batches larger than every captured capacity, run eagerly through TorchSession;
``graph_stats`` counts each kind.

``GraphSession(capture=False)`` runs the same padded static path without capturing (any device):
the tests use it on the CPU to check the padding against the eager path. Given
``encoder_capacities``, a model with a vision tower also runs its encoder as static steps, one
graph per patch capacity (runtime/encoder_graphs.py), captured on the first step with images.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from k3trt.config import ModelConfig
from k3trt.model.context import StepContext
from k3trt.runtime.cuda_graph import capture
from k3trt.runtime.encoder_graphs import EncoderGraphs
from k3trt.runtime.engine import Batch, TorchSession
from k3trt.runtime.kv_cache import CachePlan

log = logging.getLogger(__name__)


def graphs_by_default(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Where steps replay graphs unless told otherwise: on CUDA in bf16/fp16, the dtypes whose every
    op has a kernel without host synchronisation (fp32 MLA falls back to the syncing reference)."""
    return torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Layout:
    """Offsets of one static step's inputs in its packed int64 buffer."""
    S: int              # sequences (the capacity)
    Q: int              # rows per sequence
    max_blocks: int     # block-table width

    @property
    def T(self) -> int:
        return self.S * self.Q

    @property
    def size(self) -> int:
        return 5 * self.T + 3 * self.S + self.S * self.max_blocks

    def views(self, buf):
        """Named slices of a packed buffer (a torch tensor or its numpy view)."""
        T, S = self.T, self.S
        # rows / logit_rows are read after the replay (which rows to hand back); they travel with
        # the inputs so that nothing is copied to the device while the graph runs (such a copy
        # from pageable memory would wait for the whole step)
        cut = [("input_ids", T), ("slot_mapping", T), ("positions", T), ("kda_slots", S), ("seq_lens", S),
               ("fresh", S), ("rows", T), ("logit_rows", T), ("block_table", S * self.max_blocks)]
        out, at = {}, 0
        for name, n in cut:
            out[name] = buf[at:at + n]
            at += n
        out["block_table"] = out["block_table"].reshape(S, self.max_blocks)
        return out

    def pad(self, out, spare_slot: int) -> dict:
        """Fill the host buffer `out` [size] (a torch tensor or its numpy view) with an all-padding
        step (no tokens, no cache writes, KDA on the spare slot); returns its views."""
        out[:] = 0
        v = self.views(out)
        v["slot_mapping"][:] = -1
        v["kda_slots"][:] = spare_slot
        v["fresh"][:] = 1
        return v

    def pack(self, batch: Batch, spare_slot: int, out: torch.Tensor) -> torch.Tensor:
        """Write `batch` into the host buffer `out` [size], padded to S sequences of Q rows: sequence
        i's rows at i·Q + j, a sequence with fewer rows (fewer drafts) padded at its end. Returns the
        padded row of each of the batch's tokens (int64 [T]; also in the buffer's ``rows``, and those
        of batch.logit_rows in its ``logit_rows``).

        A padded row writes no cache row and reads as if all Q rows were written (row j sees
        ctx + j + 1 tokens), so the real rows see exactly their own context; its KDA update runs
        after the real rows', and the caller restores the state after the last real row.
        Written in numpy over the buffer's memory: each torch call costs microseconds of host time,
        and a step's host time is time the GPU waits (at batch 1 this was 0.24 ms in torch)."""
        S, Q, n = self.S, self.Q, len(batch.q_lens)
        if n > S or not all(1 <= x <= Q for x in batch.q_lens) or batch.block_table.shape[1] > self.max_blocks:
            raise ValueError(f"static step S={S} Q={Q} max_blocks={self.max_blocks} cannot hold {n} sequences "
                             f"of {sorted(set(batch.q_lens))} rows over {batch.block_table.shape[1]} blocks")
        q = np.asarray(batch.q_lens, dtype=np.int64)
        starts = np.cumsum(q) - q
        rows = np.repeat(np.arange(n) * Q - starts, q) + np.arange(batch.num_tokens)
        v = self.pad(out.numpy(), spare_slot)
        v["input_ids"][rows] = batch.input_ids.numpy()
        v["slot_mapping"][rows] = batch.slot_mapping.numpy()
        ctx = np.asarray(batch.ctx_lens, dtype=np.int64)
        v["positions"][:n * Q] = (ctx[:, None] + np.arange(Q)).reshape(-1)
        v["kda_slots"][:n] = batch.kda_slots.numpy()
        v["seq_lens"][:n] = ctx + Q
        v["fresh"][:n] = ctx == 0
        v["block_table"][:n, :batch.block_table.shape[1]] = batch.block_table.numpy()
        v["rows"][:len(rows)] = rows
        v["logit_rows"][:len(batch.logit_rows)] = rows[batch.logit_rows.numpy()]
        return torch.from_numpy(rows)


class StaticStep:
    """One (S, Q) shape: its device input buffer, its outputs, and its graph when captured."""

    def __init__(self, layout: Layout, device: torch.device):
        self.layout = layout
        self.dev = torch.zeros(layout.size, dtype=torch.int64, device=device)
        self.host = torch.zeros(layout.size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.views = layout.views(self.dev)         # made once: slicing costs host time every step

    def context(self) -> tuple[torch.Tensor, StepContext]:
        """input_ids and the StepContext, as views of the device buffer (inside the graph)."""
        L, v = self.layout, self.views
        ctx = StepContext((L.Q,) * L.S, (0,) * L.S, v["slot_mapping"], v["block_table"].to(torch.int32),
                          v["kda_slots"], save_kda_states=L.Q > 1, dev_positions=v["positions"],
                          dev_seq_lens=v["seq_lens"].to(torch.int32), dev_fresh=v["fresh"].bool())
        return v["input_ids"], ctx


def shift_packed(st: StaticStep, n: int, shift: torch.Tensor, block_size: int) -> None:
    """Move the first n sequences of the packed step `shift` (int64 [n], on the device) rows further
    into their context: positions and lengths grow, and each real row's cache slot is read again
    from the block table at its new position (padding rows keep slot -1)."""
    v, Q = st.views, st.layout.Q
    pos = v["positions"].view(-1, Q)[:n]
    pos += shift[:, None]
    v["seq_lens"][:n] += shift
    slots = v["slot_mapping"].view(-1, Q)[:n]
    moved = v["block_table"][:n].gather(1, pos // block_size) * block_size + pos % block_size
    slots.copy_(torch.where(slots >= 0, moved, slots))


class GraphSession(TorchSession):
    """TorchSession whose uniform decode / verify steps replay captured graphs (module doc)."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, plan: CachePlan, *, device: torch.device | str,
                 dtype: torch.dtype, kv_dtype: torch.dtype, kv_scale: float = 1.0, max_q: int = 0,
                 capacities: tuple[int, ...], q_values: tuple[int, ...], max_blocks: int, capture: bool = True,
                 encoder_capacities: tuple[int, ...] | None = None):
        super().__init__(model, cfg, plan, device=device, dtype=dtype, kv_dtype=kv_dtype, kv_scale=kv_scale,
                         max_q=max_q, spare_slots=1)
        self.spare_slot = plan.num_slots            # the one slot past the cache manager's
        self.capacities = tuple(capacities)
        self.capture = capture and self.device.type == "cuda"
        self.graph_stats: Counter = Counter()
        self.steps = {(S, Q): StaticStep(Layout(S, Q, max_blocks), self.device)
                      for S in capacities for Q in q_values if Q <= max(max_q, 1)}
        if self.capture:
            self._capture_all()
        tower = getattr(model, "vision", None)
        self._encoder = None if tower is None or encoder_capacities is None else (tower, tuple(encoder_capacities))
        self.encoder_graphs: EncoderGraphs | None = None    # on the first image step: text-only runs capture none

    # ---------------------------------------------------------------------------------- capture
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # A sharded model's steps hold NCCL collectives (every rank captures the same graphs in the
        # same order, so they pair up). NCCL's watchdog thread queries events while this thread
        # captures: the capture must refuse unsafe calls of this thread only, and start after the
        # warm-up's collectives are done.
        sharded = getattr(self.model, "comm", None) is not None and self.model.comm.pc.world_size > 1
        mode = "thread_local" if sharded else "global"
        # largest first: later, smaller graphs reuse the pool's blocks
        for (S, Q), st in sorted(self.steps.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
            st.layout.pad(st.host, self.spare_slot)        # capture runs on an all-padding step
            st.dev.copy_(st.host)
            st.graph = capture(lambda st=st: self._run_static(st), self.device, pool, mode=mode, sync_before=sharded)
        torch.cuda.synchronize(self.device)
        log.info("captured %d step graphs (capacity x rows: %s) in %.1fs", len(self.steps),
                 ", ".join(f"{S}x{Q}" for S, Q in sorted(self.steps)), time.perf_counter() - t0)

    def _run_static(self, st: StaticStep) -> None:
        ids, ctx = st.context()
        st.hidden = self.model(ids, ctx, self.cache)
        st.logits = self.model.logits(st.hidden)

    # ---------------------------------------------------------------------------------- steps
    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        if self._encoder is None:
            return super().encode_images(pixel_values, grid_thws)
        if self.encoder_graphs is None:
            tower, caps = self._encoder
            self.encoder_graphs = EncoderGraphs(tower, caps, device=self.device, dtype=next(tower.parameters()).dtype,
                                                capture=self.capture)
        return self.encoder_graphs(pixel_values, grid_thws)

    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> torch.Tensor:
        """device_ids: the step's ids on the device, int64 [T] (one row per sequence) or [S, q] (row j
        of sequence i at [i, j]; ids past a sequence's rows are ignored). shift: int64 [S] on the
        device, rows each sequence's context grows by after `batch` was packed (its positions,
        length and cache slots move with it; runtime/spec_ahead.py)."""
        need = max(batch.q_lens)
        st = min((st for (S, Q), st in self.steps.items() if S == batch.capacity and Q >= need),
                 key=lambda st: st.layout.Q, default=None)
        if st is None or batch.block_table.shape[1] > st.layout.max_blocks:
            if shift is not None or device_ids is not None and device_ids.dim() == 2:
                raise ValueError(f"no static step holds {len(batch.q_lens)} sequences of up to {need} rows over "
                                 f"{batch.block_table.shape[1]} blocks: device ids by row and shifts need one")
            self.graph_stats["eager"] += 1
            return super().verify(batch, device_ids)
        n = len(batch.q_lens)
        if device_ids is not None and (device_ids.shape[0] != n or device_ids.dim() == 2 and device_ids.shape[1] >
                                       st.layout.Q or device_ids.dim() == 1 and st.layout.Q != 1):
            raise ValueError(f"device_ids {tuple(device_ids.shape)} do not fit {n} sequences at Q={st.layout.Q}")
        self.graph_stats["graph" if self.capture else "static"] += 1
        if st.copied is not None:
            st.copied.synchronize()            # the previous step's copy out of st.host is done
        st.layout.pack(batch, self.spare_slot, st.host)
        st.dev.copy_(st.host, non_blocking=True)
        if device_ids is not None:      # sequence i's rows start at i·Q
            ids = device_ids.view(n, -1)
            st.views["input_ids"].view(-1, st.layout.Q)[:n, :ids.shape[1]].copy_(ids)
        if shift is not None:
            shift_packed(st, n, shift, self.plan.block_size)
        short = [i for i, n in enumerate(batch.q_lens) if n < st.layout.Q]
        if short:       # index tensors made now: a copy to the device after the replay would wait for it
            short = torch.stack([batch.kda_slots[short], torch.tensor(batch.q_lens)[short] - 1])
            if self.device.type == "cuda":   # pinned: a pageable copy would wait for a step launched before
                short = short.pin_memory().to(self.device, non_blocking=True)
            short = (short[0], short[1])
        if st.copied is not None:
            st.copied.record()
        with torch.inference_mode():
            if st.graph is not None:
                st.graph.replay()
            else:
                self._run_static(st)
        if short:       # their KDA state went on through the padding rows: back to their last real row
            self.graph_stats["padded drafts"] += 1
            self._restore_kda(*short)
        v = st.views
        self.hidden = st.hidden[v["rows"][:batch.num_tokens]] if batch.keep_hidden else None
        return st.logits[v["logit_rows"][:len(batch.logit_rows)]]
