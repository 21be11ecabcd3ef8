"""Image encoding speed: the vision tower + merge + projector (k3trt.model.vision.VisionEncoder) at
K3's vision dimensions (MoonViT as Kimi K2.5 publishes it: 27 layers, 1152 wide, 16 heads, MLP
4304, 2×2 merge; projector to K3's 7168), bf16, random weights, on batches of several image sizes.

    PYTHONPATH=. python benchmarks/vision_encode.py [--json benchmarks/results/vision_encode_h200.json]
    PYTHONPATH=. python benchmarks/vision_encode.py --device cpu --tiny          # smoke test

Per batch and attention path (varlen flash over all images, SDPA per image): ms per call (median
of CUDA-event timings; "call" = the grid metadata made on the host, then the encoder; "encode" =
the device work alone, metadata ready), ms per image, images/s, and the roofline: the batch's FLOPs (GEMMs + attention) over the bf16 GEMM ceiling
measured in the same run; ratio = roofline / encode time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from k3trt.model.vision import VisionConfig, VisionEncoder, vision_batch

from harness import best_s, cpu_ceilings, machine, measure, median_ms, print_table, record, write_json  # noqa: I001

K3_VISION = VisionConfig(text_hidden_size=7168)
TINY = VisionConfig(text_hidden_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, pos_emb_height=8, pos_emb_width=8)
# (name, grids in patches (t, h, w)): what preprocessing gives, e.g. 448×448 px -> 32×32 patches
BATCHES = [
    ("1 × 448²", [(1, 32, 32)]),
    ("8 × 448²", [(1, 32, 32)] * 8),
    ("4 mixed (448², 896×672, 336×560, 1344×1008)", [(1, 32, 32), (1, 64, 48), (1, 24, 40), (1, 96, 72)]),
    ("1 × 1792² (max budget)", [(1, 128, 128)]),
]
TINY_BATCHES = [("1 × 56²", [(1, 4, 4)]), ("3 mixed", [(1, 4, 4), (1, 8, 6), (1, 2, 10)])]


def flops(cfg: VisionConfig, grids) -> float:
    """Multiply-adds × 2 of one call: patch embedding, per layer the projections, MLP and
    attention (QKᵀ and PV over each image's own patches), the projector."""
    h, inter, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    n = sum(t * gh * gw for t, gh, gw in grids)
    tokens = sum(gh * gw // cfg.merge_area for _, gh, gw in grids)
    dense = 2 * n * (3 * p * p * h) + cfg.num_hidden_layers * 2 * n * (4 * h * h + 2 * h * inter)
    attn = cfg.num_hidden_layers * sum(4 * (t * gh * gw) ** 2 * h for t, gh, gw in grids)
    proj = 2 * tokens * (cfg.merged_size ** 2 + cfg.merged_size * cfg.text_hidden_size)
    return float(dense + attn + proj)


def random_encoder(cfg: VisionConfig, device: str, dtype: torch.dtype) -> VisionEncoder:
    enc = VisionEncoder(cfg).to(device=device, dtype=dtype).eval()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, prm in enc.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            prm.copy_(base + 0.02 * torch.randn(prm.shape, generator=g, device=device, dtype=torch.float32))
    return enc


def time_batch(enc: VisionEncoder, cfg: VisionConfig, pixels: torch.Tensor, grids, mode: str, cuda: bool,
               args) -> dict:
    """ms per call (grid metadata made on the host, then the encoder) and per encode (metadata
    ready on the device), attention `mode`."""
    batch = vision_batch(cfg, grids).to(pixels.device)

    def call():
        return enc.encode(pixels, vision_batch(cfg, grids).to(pixels.device), attention=mode)

    def encode():
        return enc.encode(pixels, batch, attention=mode)
    with torch.no_grad():
        if cuda:
            return {"call_ms": round(median_ms(call, warmup=2, reps=args.reps), 3),
                    "encode_ms": round(median_ms(encode, warmup=2, reps=args.reps), 3)}
        return {"call_ms": round(best_s(call, reps=3) * 1e3, 3), "encode_ms": round(best_s(encode, reps=3) * 1e3, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny tower and small images (smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    cfg, batches = (TINY, TINY_BATCHES) if args.tiny else (K3_VISION, BATCHES)
    dtype = torch.bfloat16 if cuda else torch.float32
    ceil = measure() if cuda else cpu_ceilings()
    enc = random_encoder(cfg, args.device, dtype)
    p = cfg.patch_size
    modes = ("varlen", "sdpa") if cuda else ("sdpa",)
    rows = []
    for name, grids in batches:
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(n, 3, p, p, device=args.device, dtype=dtype)
        fl = flops(cfg, grids)
        roof_ms = fl / (ceil["gemm_tflops"] * 1e12) * 1e3
        for mode in modes:
            row = {"batch": name, "attention": mode, "images": len(grids), "patches": n,
                   "tokens": sum(h * w // cfg.merge_area for _, h, w in grids), "roofline_ms": round(roof_ms, 3)}
            try:
                row.update(time_batch(enc, cfg, pixels, grids, mode, cuda, args))
            except (RuntimeError, ValueError) as e:          # a path this torch or GPU lacks: say so, go on
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            if "encode_ms" in row:
                row.update(ms_per_image=round(row["call_ms"] / len(grids), 3),
                           images_per_s=round(len(grids) / row["call_ms"] * 1e3, 1),
                           tflops=round(fl / (row["encode_ms"] * 1e-3) / 1e12, 2))
            rows.append(row)
            print(row, flush=True)
    print_table(f"vision encode ({'tiny' if args.tiny else 'K3 MoonViT'}, {str(dtype).removeprefix('torch.')})",
                ceil, [("batch", "batch", 46, "s"), ("attention", "attention", 9, "s"), ("patches", "patches", 8, "d"),
                       ("call ms", "call_ms", 9, ".2f"),
                       ("encode ms", "encode_ms", 10, ".2f"), ("ms/image", "ms_per_image", 9, ".2f"),
                       ("images/s", "images_per_s", 9, ".1f"), ("TFLOP/s", "tflops", 8, ".1f"),
                       ("roof ms", "roofline_ms", 8, ".2f"), ("ratio", "ratio:roofline_ms/encode_ms", 6, ".2f")],
                rows, note="ratio = roofline (FLOPs / measured GEMM ceiling) / encode time; 1.0 is the ceiling")
    write_json(args.json, record(__file__, argv, machine=machine(args.device), ceilings=ceil,
                                 config={"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                                         "heads": cfg.num_attention_heads, "mlp": cfg.intermediate_size,
                                         "text_hidden": cfg.text_hidden_size, "dtype": str(dtype)},
                                 rows=rows))


if __name__ == "__main__":
    main()
