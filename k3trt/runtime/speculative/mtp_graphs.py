"""MTP draft steps as static steps: one CUDA graph per (batch capacity, rows per sequence), as the
target's decode steps (graphs.py, whose ``Layout`` / ``StaticStep`` packing this reuses).

An MTP step runs sequences of Q rows: the draft steps (Q = 1: the previous draft after its chained
hidden) and the catch-up step 0 after a verify (Q = n + 2 for n accepted drafts: the verified rows
whose true target hiddens came back). Each (S, Q) with S a power-of-two capacity up to max_live
and Q in 1 .. k_max + 2 (at most MLA's absorbed-form limit, ABSORBED_MAX_Q: the naive form reads
host lengths) is captured once; a step replays the smallest graph that holds it, its
sequences padded at their ends (padding rows write no cache row; padding sequences see nothing).
Inputs travel in the step's packed int64 buffer plus one static buffer of previous hiddens
[S·Q, H], written at the real rows; inside the graph the MTP layer's output is taken at each
sequence's last real row (the buffer's ``logit_rows``), normed, and scored by the draft head
(full or reduced vocabulary). Steps wider than every graph (a whole prompt at step 0, a batch
past max_live, a history past the block table) run eagerly.

``capture=False`` runs the same padded static path without capturing (any device): the tests
check it against the eager step on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Sequence

import torch

from k3trt.engine.capacities import power_of_two_capacities
from k3trt.model.context import StepContext
from k3trt.model.mla import ABSORBED_MAX_Q
from k3trt.runtime.engine import Seq, make_batch
from k3trt.runtime.graphs import Layout, StaticStep, shift_packed
from k3trt.runtime.cuda_graph import capture

log = logging.getLogger(__name__)

MTPForward = Callable[[torch.Tensor, torch.Tensor, StepContext], torch.Tensor]   # (ids, prev, ctx) -> h [T, H]


class MTPGraphs:
    """Static MTP steps per (capacity, Q) (module doc)."""

    def __init__(self, forward: MTPForward, finish: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], *,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, max_live: int, k_max: int,
                 max_blocks: int, block_size: int, capture: bool = True):
        self.forward, self.finish = forward, finish       # finish: h at last rows -> (g, logits)
        self.block_size, self.device = block_size, device
        self.capacities = tuple(power_of_two_capacities(max_live))
        self.capture = capture and device.type == "cuda"
        self.stats: Counter = Counter()
        self.steps: dict[tuple[int, int], StaticStep] = {}
        self.prev: dict[tuple[int, int], torch.Tensor] = {}
        self.out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.packed: dict[tuple[int, int], int] = {}      # tokens of the step last packed per shape
        for S in self.capacities:
            for Q in range(1, min(k_max + 2, ABSORBED_MAX_Q) + 1):    # wider steps take MLA's naive form
                self.steps[S, Q] = StaticStep(Layout(S, Q, max_blocks), device)
                self.prev[S, Q] = torch.zeros(S * Q, hidden_size, dtype=dtype, device=device)
        if self.capture:
            self._capture_all()

    def fits(self, steps: Sequence) -> tuple[int, int] | None:
        """The (S, Q) graph for `steps` (SeqStep-likes), or None: the step runs eagerly."""
        S = next((c for c in self.capacities if c >= len(steps)), None)
        Q = max(len(s.tokens) for s in steps)
        if S is None or (S, Q) not in self.steps:
            return None
        if max(len(s.blocks) for s in steps) > self.steps[S, Q].layout.max_blocks:
            return None
        return S, Q

    def run(self, key: tuple[int, int], steps: Sequence, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [n, H], logits [n, N]) at each sequence's last row, for `steps` and their previous
        hiddens prev [T, H] (rows in step order). The outputs are views of static buffers, valid
        until the next run of the same shape."""
        self.pack(key, steps)
        return self.replay(key, len(steps), prev)

    def pack(self, key: tuple[int, int], steps: Sequence) -> None:
        """Write `steps` (their host-known part) into the (S, Q) step's device buffer."""
        st = self.steps[key]
        batch = make_batch([Seq(list(s.tokens), s.ctx_len, list(s.blocks), 0, 1) for s in steps], self.block_size,
                           capacity=key[0])
        if st.copied is not None:
            st.copied.synchronize()            # the previous run's copy out of st.host is done
        st.layout.pack(batch, 0, st.host)
        st.dev.copy_(st.host, non_blocking=True)
        if st.copied is not None:
            st.copied.record()
        self.packed[key] = batch.num_tokens

    def replay(self, key: tuple[int, int], n: int, prev: torch.Tensor, *,
               ids: tuple[torch.Tensor, torch.Tensor] | None = None, last: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the packed step of n sequences with inputs the host has not seen (all on the device,
        read without waiting): ids = (token indices in step order int64 [m], their ids [m]) over the
        packed ids; last: int64 [n], the row of each sequence whose output is taken (default its last
        packed row); shift: int64 [n], rows each sequence's context grew by since it was packed
        (graphs.shift_packed). The outputs are views of static buffers, as run's."""
        st, buf = self.steps[key], self.prev[key]
        v = st.views
        buf[v["rows"][:self.packed[key]]] = prev.to(buf.dtype)
        if ids is not None:
            v["input_ids"][v["rows"][ids[0]]] = ids[1]
        if last is not None:
            v["logit_rows"][:n] = torch.arange(n, device=last.device) * st.layout.Q + last
        if shift is not None:
            shift_packed(st, n, shift, self.block_size)
        self.stats["graph" if st.graph is not None else "static"] += 1
        with torch.inference_mode():
            if st.graph is not None:
                st.graph.replay()
            else:
                self._run_static(key)
        g, logits = self.out[key]
        return g[:n], logits[:n]

    # ---------------------------------------------------------------------------------- internals
    def _run_static(self, key: tuple[int, int]) -> None:
        st = self.steps[key]
        ids, ctx = st.context()
        h = self.forward(ids, self.prev[key], ctx)
        self.out[key] = self.finish(h[st.views["logit_rows"][:st.layout.S]])

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for key, st in sorted(self.steps.items(), key=lambda kv: -kv[0][0] * kv[0][1]):   # largest first
            st.layout.pad(st.host, 0)          # capture runs on an all-padding step
            st.dev.copy_(st.host)
            st.graph = capture(lambda key=key: self._run_static(key), self.device, pool)
        torch.cuda.synchronize(self.device)
        log.info("captured %d MTP draft-step graphs in %.1fs", len(self.steps), time.perf_counter() - t0)
