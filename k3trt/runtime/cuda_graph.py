"""Capturing one step as a CUDA graph, the way every graph of the runtime is captured (decode and
verify steps, MTP draft steps, vision encoder steps)."""

from __future__ import annotations

from typing import Callable

import torch


def capture(run: Callable[[], None], device: torch.device, pool, *, mode: str = "global",
            sync_before: bool = False) -> torch.cuda.CUDAGraph:
    """`run` warmed up twice on a side stream (compiles the Triton kernels, settles the allocator),
    then captured into a graph drawing on memory pool `pool`. `mode`: torch.cuda.graph's
    capture_error_mode; `sync_before`: synchronise the device between warm-up and capture (a sharded
    step's collectives must be done before NCCL's watchdog meets a capturing thread)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    if sync_before:
        torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode), torch.inference_mode():
        run()
    return graph
