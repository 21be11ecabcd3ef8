"""The vision encoder as static steps, one per encoder patch capacity, each a CUDA graph on CUDA.

    graphs = EncoderGraphs(model.vision, capacities, device=dev, dtype=torch.bfloat16)
    rows = graphs(pixel_values, grid_thws)     # [sum image tokens, text hidden], as VisionEncoder

An encoder call of P patches (whole images) pads to the smallest capacity >= P and runs that static
shape, replaying its captured graph on CUDA; more patches than the largest capacity, or more images
than a step's ``IMAGE_SLOTS``, run eagerly (``stats`` counts each kind). The capacities are the
engine dir's (``Capacities.encoder``: ``k3trt build --encoder-capacities``), else
``DEFAULT_CAPACITIES``.

A call overwrites every buffer a replay reads: the pixels (padding rows zeroed, so nothing of an
earlier call reaches a real row through the merge or attention), geometry.vision_batch's per-patch
metadata padded to the capacity, and the patch offsets for varlen attention as a fixed-length
cu_seqlens ``[0, each image's end, the last end repeated for unused slots, P]``: unused slots are
empty sequences and the padding rows one sequence of their own. The graph's maximum sequence
length is the capacity, an upper bound (flash attention's extra blocks exit at once).

Attention: "varlen" where the tower can run it (CUDA, bf16/fp16, torch's varlen attention), else
"masked", the exported graphs' one SDPA under a same-image mask (O(P²): the fallback).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
from torch import Tensor

from k3trt.model.vision import VisionBatch, VisionEncoder, vision_batch
from k3trt.model.vision.tower import attention_mode
from k3trt.runtime.cuda_graph import capture

log = logging.getLogger(__name__)

DEFAULT_CAPACITIES = (1024, 4096, 16384)     # patches: a 448², a 896² and a 1792² image
IMAGE_SLOTS = 16                             # images one static step holds
META = ("pos_index", "pos_weight", "frame", "rope_pos", "segment", "merge_dest", "merge_weight")


class EncoderStep:
    """One capacity's device buffers, its output and its graph when captured."""

    def __init__(self, encoder: VisionEncoder, capacity: int, device: torch.device, dtype: torch.dtype):
        cfg = encoder.cfg
        self.capacity = P = capacity
        self.cfg = cfg
        self.pixels = torch.zeros(P, 3, cfg.patch_size, cfg.patch_size, dtype=dtype, device=device)
        template = vision_batch(cfg, [(1, *cfg.merge_kernel_size)], capacity=P)
        self.meta = {k: torch.zeros_like(getattr(template, k), device=device) for k in META}
        self.cu = torch.zeros(IMAGE_SLOTS + 2, dtype=torch.int32, device=device)
        self.batch = VisionBatch(grids=(), **self.meta, num_patches=P, num_tokens=P // cfg.merge_area,
                                 cu_seqlens=self.cu, max_len=P)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None

    def pack(self, pixel_values: Tensor, grids: list) -> int:
        """Write a call's images into the buffers (every element); returns their token count."""
        host = vision_batch(self.cfg, grids, capacity=self.capacity)
        n = host.num_patches
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches; grid_thws {grids} need {n}")
        self.pixels[:n].copy_(pixel_values)
        self.pixels[n:].zero_()
        for k in META:
            self.meta[k].copy_(getattr(host, k))
        ends = host.cu_seqlens[1:]
        cu = torch.full((IMAGE_SLOTS + 2,), n, dtype=torch.int32)
        cu[0], cu[1:1 + len(ends)], cu[-1] = 0, ends, self.capacity
        self.cu.copy_(cu)
        return host.num_tokens


class EncoderGraphs:
    """The encoder over static capacities (module doc); `capture`: CUDA graphs (CUDA only), else
    the same static steps run eagerly (the CPU tests check the padding this way)."""

    def __init__(self, encoder: VisionEncoder, capacities: tuple[int, ...], *, device: torch.device | str,
                 dtype: torch.dtype, capture: bool = True, attention: str = "auto"):
        self.encoder, self.device, self.dtype = encoder, torch.device(device), dtype
        area = encoder.cfg.merge_area
        bad = [c for c in capacities if c % area]
        if bad:
            raise ValueError(f"encoder capacities {bad} are not multiples of {area} (the merge kernel's area)")
        probe = torch.zeros(1, dtype=dtype, device=self.device)
        mode = attention_mode(attention, probe)
        self.attention = "masked" if mode == "sdpa" else mode     # sdpa runs per image: not static
        self.steps = [EncoderStep(encoder, c, self.device, dtype) for c in sorted(capacities)]
        self.capture = capture and self.device.type == "cuda"
        self.stats: Counter = Counter()
        if self.capture:
            self._capture_all()

    def _run(self, st: EncoderStep) -> None:
        st.out = self.encoder.encode(st.pixels, st.batch, attention=self.attention)

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        kh, kw = self.encoder.cfg.merge_kernel_size
        for st in sorted(self.steps, key=lambda s: -s.capacity):     # largest first: the rest reuse its pool
            st.pack(torch.zeros(kh * kw, *st.pixels.shape[1:], dtype=self.dtype, device=self.device), [(1, kh, kw)])
            st.graph = capture(lambda st=st: self._run(st), self.device, pool)
        torch.cuda.synchronize(self.device)
        log.info("captured %d encoder graphs (patch capacities %s, %s attention) in %.1fs", len(self.steps),
                 [s.capacity for s in self.steps], self.attention, time.perf_counter() - t0)

    def pick(self, patches: int, images: int) -> EncoderStep | None:
        if images > IMAGE_SLOTS:
            return None
        return next((st for st in self.steps if st.capacity >= patches), None)

    def __call__(self, pixel_values: Tensor, grid_thws: Tensor) -> Tensor:
        """pixel_values [P, 3, p, p], grid_thws int64 [n, 3] -> [sum image tokens, text hidden]
        (a fresh tensor: the graph's output buffer is overwritten by the next call)."""
        grids = grid_thws.tolist()
        pixels = pixel_values.to(self.device, self.dtype)
        st = self.pick(pixels.shape[0], len(grids))
        with torch.inference_mode():
            if st is None:
                self.stats["eager"] += 1
                return self.encoder(pixels, grid_thws.to(self.device))
            tokens = st.pack(pixels, grids)
            if st.graph is not None:
                self.stats["graph"] += 1
                st.graph.replay()
            else:
                self.stats["static"] += 1
                self._run(st)
            return st.out[:tokens].clone()
