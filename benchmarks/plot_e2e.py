"""Draw benchmarks/e2e.py's JSON as one PNG for the README (run on any machine with matplotlib).

    python benchmarks/plot_e2e.py benchmarks/results/e2e_h200.json [-o benchmarks/results/e2e_h200.png]

Left: decode step latency against batch, measured (CUDA graphs; eager; speculative per its
draft+verify step) and the roofline of the same step, on log axes. Right: tokens/s of every case
(decode per batch, speculative, eager, transformers' generate, prefill), with measured / roofline
written on each bar that has one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(doc: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in doc["cases"] if "error" not in c and "skipped" not in c and c.get("tokens_per_s")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    for kind, style, label in (("decode", "o-", "decode, CUDA graphs"), ("eager", "s--", "decode, eager"),
                               ("eager-ref", "x--", "decode, eager, no plugins"), ("hf", "^:", "transformers generate")):
        rows = sorted((c for c in cases if c["kind"] == kind and c.get("step_ms")), key=lambda c: c["batch"])
        if rows:
            ax1.plot([c["batch"] for c in rows], [c["step_ms"] for c in rows], style, label=label)
    roof = sorted((c for c in cases if c["kind"] == "decode" and "roofline" in c), key=lambda c: c["batch"])
    if roof:
        ax1.plot([c["batch"] for c in roof], [c["roofline"]["roofline_ms"] for c in roof], "k-", lw=2.5, alpha=.35,
                 label="roofline (bytes/copy bw, flops/GEMM)")
    for c in cases:
        if c["kind"] == "spec" and c.get("step_ms"):
            ax1.plot([c["batch"]], [c["step_ms"]], "D", label=f"{c['speculative']} K{c['spec_tokens']} (draft+verify)")
    ax1.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="median step (ms)",
            title="decode step latency vs roofline")
    ax1.grid(True, which="both", alpha=.3)
    ax1.legend(fontsize=7)

    names = [c["name"] for c in cases]
    vals = [c["tokens_per_s"] for c in cases]
    colors = {"decode": "C0", "eager": "C1", "hf": "C2", "spec": "C3", "prefill": "C4", "eager-ref": "C5"}
    bars = ax2.barh(names, vals, color=[colors.get(c["kind"], "C7") for c in cases])
    for b, c in zip(bars, cases):
        note = f" {c['ratio']:.2f}x roof" if c.get("ratio") else ""
        if c.get("mean_accepted_length"):
            note += f", acc {c['mean_accepted_length']}"
        ax2.text(b.get_width(), b.get_y() + b.get_height() / 2, note, va="center", fontsize=7)
    ax2.set(xscale="log", xlabel="tokens/s (log)", title="throughput per case")
    ax2.invert_yaxis()
    ax2.grid(True, axis="x", which="both", alpha=.3)
    m, ceil = doc["machine"], doc["machine"]["ceilings"]
    fig.suptitle(f"k3trt e2e, {doc['preset']} preset ({doc['model']['params'] / 1e9:.2f}B params, {doc['dtype']}) on "
                 f"{m['device']}: copy {ceil['copy_gbps']} GB/s, GEMM {ceil['gemm_tflops']} TFLOP/s; torch "
                 f"{m['torch']}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=None, help="default: the JSON's path with .png")
    args = ap.parse_args(argv)
    out = plot(json.loads(args.json.read_text()), args.output or args.json.with_suffix(".png"))
    print(out)
    return out


if __name__ == "__main__":
    main()
