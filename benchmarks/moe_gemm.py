"""The routed experts' grouped GEMM at K3's expert sizes: our Triton kernel (k3trt::moe_gemm) over a
sweep of tile configs against torch's grouped GEMM (torch._grouped_mm), per decode batch.

    PYTHONPATH=. python benchmarks/moe_gemm.py [--tokens 1,8,32,128,512] [--json OUT]

Each case routes `tokens` tokens to top-16 of 32 experts at random (the medium preset's routing),
and times the two GEMMs of one MoE layer: gate|up fused ([32, 6144, 3584]) and down
([32, 3584, 3072]). The roofline is the bytes of the experts that got rows (each read once) plus
activations, over the copy bandwidth measured in the same run, or the flops over the GEMM rate.
Prints one row per (tokens, matrix): torch's time, the time of the config the op picks
(moe_gemm_triton.pick_config) and of the sweep's best, each with its fraction of the roofline; the
JSON keeps every config's time.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3trt.plugins.moe_gemm_triton import moe_gemm_fwd  # noqa: E402

from harness import measure, median_ms, print_table, record, write_json  # noqa: E402

log = logging.getLogger("moe_gemm")
E, TOPK = 32, 16
MATRICES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
COLUMNS = [("tokens", "tokens", 6, "d"), ("matrix", "matrix", 8, "s"), ("experts", "active_experts", 7, "d"),
           ("roof ms", "roofline_ms", 8, ".4f"), ("torch ms", "torch_ms", 9, ".4f"), ("frac", "torch_frac", 5, ".2f"),
           ("picked", "picked_ms", 8, ".4f"), ("frac", "picked_frac", 5, ".2f"), ("best ms", "best_ms", 8, ".4f"),
           ("frac", "best_frac", 5, ".2f"), ("best config (BM, BN, BK, warps, stages)", "best_config", 42, "s")]


def configs(rows_per_expert: float) -> list[tuple[int, int, int, int, int]]:
    if rows_per_expert <= 2:      # weight streaming: wide sweep of the weight tile and the pipeline
        return list(itertools.product((16,), (32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)))
    # an expert whose rows overflow one BM tile reads its weights again: sweep BM around the mean
    return list(itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)))


def routed(tokens: int, g: torch.Generator) -> torch.Tensor:
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(tokens)])
    counts = ids.flatten().bincount(minlength=E)
    return counts.cumsum(0).to(torch.int32).cuda()


def case(tokens: int, name: str, ceil: dict, g: torch.Generator) -> dict:
    N, K = MATRICES[name]
    P = tokens * TOPK
    offs = routed(tokens, g)
    active = int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum())
    x = torch.randn(P, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    nbytes = active * N * K * 2 + P * (N + K) * 2
    roof_ms = max(nbytes / ceil["copy_gbps"] / 1e6, 2 * P * N * K / ceil["gemm_tflops"] / 1e9)
    want = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    torch_ms = median_ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), reps=20)
    times = {}
    for cfg in configs(P / E):
        try:
            y = moe_gemm_fwd(x, w, offs, config=cfg)
            err = ((y.float() - want.float()).norm() / want.float().norm()).item()
            if not err < 1e-2:
                log.error("config %s: rel err %.3g", cfg, err)
                continue
            times[str(cfg)] = median_ms(lambda: moe_gemm_fwd(x, w, offs, config=cfg), reps=20)
        except Exception as e:  # a config Triton cannot build (shared memory) is skipped, and said
            log.warning("config %s: %s", cfg, str(e).splitlines()[0][:120])
    best = min(times, key=times.get)
    picked_ms = median_ms(lambda: moe_gemm_fwd(x, w, offs), reps=20)      # moe_gemm_triton.pick_config
    row = {"tokens": tokens, "matrix": name, "pairs": P, "active_experts": active, "roofline_ms": roof_ms,
           "torch_ms": torch_ms, "torch_frac": roof_ms / torch_ms, "best_config": best,
           "best_ms": times[best], "best_frac": roof_ms / times[best], "picked_ms": picked_ms,
           "picked_frac": roof_ms / picked_ms, "configs": times}
    log.info("%s", {k: v for k, v in row.items() if k != "configs"})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,8,16,32,64,128")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ceil = measure()
    log.info("ceilings: %s", ceil)
    g = torch.Generator().manual_seed(0)
    rows = [case(t, m, ceil, g) for t in map(int, args.tokens.split(",")) for m in MATRICES]
    print_table("moe_gemm: one MoE layer's routed-expert GEMMs, top-16 of 32 experts", ceil, COLUMNS, rows,
                "frac: roofline / time; picked: the config the op takes; best: the sweep's fastest")
    write_json(args.json, record(__file__, ceilings=ceil, rows=rows))


if __name__ == "__main__":
    main()
