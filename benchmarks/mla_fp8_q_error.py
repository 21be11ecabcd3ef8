"""What quantising Q to fp8-e4m3 would cost MLA verification in accuracy (CPU, fp32 reference).

    python benchmarks/mla_fp8_q_error.py

An fp8 Q·K^T (wgmma e4m3 x e4m3, twice bf16's rate) would be the way for an fp8 cache to leave the
16-bit tensor-core floor behind (mla_verify_notes.md, v6). This prints the relative error
‖out - ref‖ / ‖ref‖ of attention with Q rounded to e4m3 (per-row scale, amax -> 448) against the
same attention in fp32, over an fp8 cache, for logits of growing sharpness; bf16 Q for scale.
Issue 11 asks for < 1e-2.
"""

from __future__ import annotations

import argparse

import torch


def attention(q, kv, scale, d_v):
    return torch.softmax((q @ kv.T) * scale, dim=-1) @ kv[:, :d_v]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=48, help="query rows (heads x Q rows per request)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    d, d_v, scale = 576, 512, 192 ** -0.5
    print(f"{'logit scale':>12} {'fp8 Q rel err':>14} {'bf16 Q rel err':>15}")
    for sharp in (1.0, 3.0, 10.0):
        e8, e16 = [], []
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(args.rows, d, generator=g) * sharp
            kv = torch.randn(args.tokens, d, generator=g).to(torch.float8_e4m3fn).float()
            ref = attention(q, kv, scale, d_v)
            s = 448.0 / q.abs().amax(-1, keepdim=True)
            q8 = (q * s).to(torch.float8_e4m3fn).float() / s
            rel = lambda out: ((out - ref).norm() / ref.norm()).item()  # noqa: E731
            e8.append(rel(attention(q8, kv, scale, d_v)))
            e16.append(rel(attention(q.bfloat16().float(), kv, scale, d_v)))
        print(f"{sharp:>12.1f} {max(e8):>14.4f} {max(e16):>15.4f}")


if __name__ == "__main__":
    main()
