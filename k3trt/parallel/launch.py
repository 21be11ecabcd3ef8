"""Start a multi-process run: one process per rank, torch.distributed initialised, NCCL's and
torch's multicast paths switched off (this workplace's H200 hosts must run without NVLink
multicast: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

    python -m k3trt.parallel.launch CKPT --tp 8 --dcp 8 --ep 8 [--interleave 1] [--dtype fp32|bf16]
           [--device cuda|cpu]        # spawns max(tp, dcp, ep) processes itself
    torchrun --nproc-per-node 8 -m k3trt.parallel.launch CKPT --tp 8 --dcp 8 --ep 8

runs the greedy equivalence check of k3trt/parallel/check.py: every rank runs the schedule on
its shard, then rank 0 runs it on the whole model on one device and compares (tokens equal,
logits close), and prints one JSON line; the exit status is 0 when every rank passed. fp32 (the
default) is the equivalence check: only the order of sums changes. In bf16 the parallel run
rounds different partial sums (and DCP prefill takes the absorbed form where one process takes
the naive one), so on random weights greedy tokens can part at a near-tie (seen on CPU, tiny
variant, bf16: tp 2 and dcp 2 / 4 kept the tokens with first-step logits 1 % - 2 % apart in
relative norm; tp4 × dcp4 × ep4 parted at one token where the bf16 single-process run itself
differs from fp32); read step0_logits_rel_norm and tokens_equal per rank as information.

From Python, ``spawn(fn, world_size, *args)`` runs ``fn(rank, *args)`` on every rank with the
process group ready (gloo on CPU, NCCL on GPUs).
Written for the multi-GPU machine; on this workplace only the gloo/CPU path has run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3trt.model.loader import load_model
from k3trt.parallel.check import compare, greedy_trace, load_trace, make_prompts, worker
from k3trt.parallel.comm import SINGLE
from k3trt.parallel.config import ParallelConfig
from k3trt.testing import rel_norm_error

# Forced in every rank before NCCL starts (not defaults: a value left over in the shell must
# not switch multicast back on).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, backend: str | None = None) -> str:
    """Initialise the default group from MASTER_ADDR / MASTER_PORT; returns this rank's device."""
    os.environ.update(MULTICAST_OFF)
    cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if cuda else "gloo")
    device = "cpu"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            **({"device_id": torch.device(device)} if cuda else {}))
    return device


def _entry(rank, fn, world_size, backend, args):
    init_process_group(rank, world_size, backend)
    try:
        fn(rank, *args)
        # no rank closes its connections while another may still be using them (a gloo rank once
        # aborted at teardown in CI: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, backend: str | None = None) -> None:
    """Run ``fn(rank, *args)`` in `world_size` fresh processes on this host (127.0.0.1); raises if
    any rank fails. `fn` must be importable (a module-level function)."""
    saved = dict(os.environ)
    os.environ.update(MULTICAST_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:                    # the children inherit the environment; the caller's is restored
        mp.spawn(_entry, args=(fn, world_size, backend, args), nprocs=world_size, join=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------------------ the check
def _check_rank(rank, ckpt, layout, out_dir, device_kind, dtype):
    device = f"cuda:{torch.cuda.current_device()}" if device_kind == "cuda" else "cpu"
    worker(rank, ckpt, [layout], out_dir, device, dtype)


def _reference_and_compare(ckpt, layout, out_dir, device, dtype) -> dict:
    cfg, model = load_model(ckpt, dtype=dtype, device=device)
    ref = greedy_trace(model, SINGLE, make_prompts(cfg.vocab_size), device=device)

    world = ParallelConfig(**layout).world_size
    # fp32: sums reordered only; bf16: relative norm as bf16 allows, loose elementwise (small logits)
    tol = dict(atol=1e-4, rtol=1e-4, rel_norm=5e-5) if dtype == torch.float32 else \
        dict(atol=0.25, rtol=5e-2, rel_norm=3e-2)
    result = {"layout": layout, "world_size": world, "dtype": str(dtype), "tokens": ref.tokens,
              "single_seconds": round(ref.seconds, 3), "ok": True, "ranks": []}
    for r in range(world):
        got = load_trace(Path(out_dir) / f"0.rank{r}.pt")
        rank = {"seconds": round(got.seconds, 3), "tokens_equal": got.tokens == ref.tokens,
                "step0_logits_rel_norm": rel_norm_error(got.logits[0], ref.logits[0])}
        try:
            compare(got, ref, **tol, name=f"rank {r}")
        except AssertionError as e:
            rank["error"] = str(e)
            result["ok"] = False
        result["ranks"].append(rank)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3trt.parallel.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dcp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="directory for the per-rank traces (default: a temporary one)")
    a = ap.parse_args(argv)

    layout = dict(tp=a.tp, dcp=a.dcp, ep=a.ep, dcp_interleave=a.interleave)
    world = ParallelConfig(**layout).world_size
    backend = "nccl" if a.device == "cuda" else "gloo"
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ["RANK"]) if torchrun else 0
    out = [a.out or (tempfile.mkdtemp(prefix="k3trt-parallel-") if rank == 0 else None)]
    if torchrun:
        if int(os.environ["WORLD_SIZE"]) != world:
            sys.exit(f"torchrun started {os.environ['WORLD_SIZE']} ranks; this layout needs {world}")
        init_process_group(rank, world, backend)
        dist.broadcast_object_list(out, src=0)                        # rank 0's directory for all
    Path(out[0]).mkdir(parents=True, exist_ok=True)
    args = (str(a.checkpoint), layout, out[0], a.device, DTYPES[a.dtype])
    if torchrun:
        _check_rank(rank, *args)
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        spawn(_check_rank, world, *args, backend=backend)
    device = "cuda:0" if a.device == "cuda" else "cpu"
    result = _reference_and_compare(args[0], layout, out[0], device, args[4])
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
