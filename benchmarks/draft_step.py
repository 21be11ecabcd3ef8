"""The cost of one MTP draft step (one draft token for each of B requests) against the bytes it
must read, for the drafter settings that change it: eager, CUDA graphs, and graphs with a reduced
draft vocabulary (the lm_head rows it scores).

    PYTHONPATH=. python benchmarks/draft_step.py --json $OUT/draft_step.json           # H200, ~1 min
    PYTHONPATH=. python benchmarks/draft_step.py --preset tiny --device cpu --quick     # CPU smoke

The medium preset (K3's per-layer dimensions; its MTP layer is one K3 decoder layer: MLA and the
latent MoE) with random weights on the device. Per batch B, B requests each get a context of C
positions in the MTP drafter's cache (random target hiddens handed over, one propose), then the
draft step MTPDrafter runs for draft 2 onwards is timed as the runtime meets it: host time
included (packing, graph replay or eager launches) up to the logits being ready, median of
--reps. Its roofline is bytes / the copy bandwidth measured in the same run: the MTP layer's
non-expert weights, the routed experts B tokens can touch (min(E, B·top_k) of them), the head
rows scored (V or the reduced N), the MLA cache rows attended (B·C) and the embedding rows.
Acceptance does not enter: a reduced vocabulary's effect on it needs a trained model.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
from harness import cpu_ceilings, machine, measure, print_table, record, write_json  # benchmarks/ is on sys.path

from k3trt.config import ModelConfig
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.runtime.speculative import DraftInput
from k3trt.runtime.speculative.draft_model import SeqStep
from k3trt.runtime.speculative.mtp import MTPDrafter

log = logging.getLogger("draft_step")
VOCAB = 129408          # the tokenizer's vocabulary rounded up, as make_checkpoint makes it


def mtp_bytes(model, cfg: ModelConfig, batch: int, ctx: int, head_rows: int) -> int:
    """What one Q = 1 MTP step over `batch` sequences of `ctx` cached positions must read."""
    layer = model.model.layers[cfg.num_hidden_layers]
    experts = [m for n, m in layer.named_modules() if n.endswith(".experts")]     # routed, not shared
    expert_bytes = sum(p.numel() * p.element_size() for e in experts for p in e.parameters())
    dense = sum(p.numel() * p.element_size() for p in layer.parameters()) - expert_bytes
    if cfg.num_experts:
        expert_bytes = expert_bytes * min(cfg.num_experts, batch * cfg.num_experts_per_token) // cfg.num_experts
    w = model.lm_head.weight
    head = head_rows * w.shape[1] * w.element_size()
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * w.element_size()
    return dense + expert_bytes + head + batch * (ctx * row + w.shape[1] * w.element_size())


def time_step(d: MTPDrafter, batch: int, ctx: int, reps: int, device: torch.device) -> float:
    """Median ms of the draft step (module doc) for `batch` requests of `ctx` positions."""
    g = torch.Generator(device="cpu").manual_seed(batch)
    hist = [torch.randint(1, 1000, (ctx + 2,), generator=g).tolist() for _ in range(batch)]
    with torch.inference_mode():
        for i, h in enumerate(hist):
            d.on_hidden(f"r{i}", 0, torch.randn(len(h) - 1, d.cfg.hidden_size, dtype=d.model.lm_head.weight.dtype,
                                                device=device))
        d.propose([DraftInput(f"r{i}", h, max_drafts=2) for i, h in enumerate(hist)], 2)
        for i, h in enumerate(hist):          # room for the timed step's row at position len(h) - 1
            assert d.blocks.grow(d.seqs[f"r{i}"].blocks, len(h), d.block_size)
        steps = [SeqStep([h[-1]], len(h) - 1, d.seqs[f"r{i}"].blocks, 0) for i, h in enumerate(hist)]
        prev = torch.randn(batch, d.cfg.hidden_size, dtype=d.model.lm_head.weight.dtype, device=device)
        times = []
        for r in range(reps + 3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            _, logits = d._step(steps, prev)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    for i in range(batch):
        d.release(f"r{i}")
    assert logits.shape[0] == batch
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=512, help="cached positions per request")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="reduced draft vocabulary size")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="smoke settings: small batches and context")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.ctx, args.draft_vocab, args.reps = "1,4", 32, 1000, 3
        if args.device == "cpu":
            torch.set_num_threads(1)
    batches = [int(x) for x in args.batches.split(",") if x]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    doc = record(__file__, argv, machine=machine(device), preset=args.preset,
                 settings={k: v for k, v in vars(args).items() if k != "json"}, cases=[])
    doc["machine"]["ceilings"] = ceil = measure() if device.type == "cuda" else cpu_ceilings()
    cfg = ModelConfig.from_dict(preset_config(args.preset, args.vocab))
    model = build_model(cfg, dtype=dtype, device=device)
    init_random_(model, 0, device=device)
    ids = torch.arange(args.draft_vocab)            # merge order: which rows does not change the cost
    modes = {"eager": dict(graphs=False), "graphs": dict(graphs=True),
             f"graphs, vocab {args.draft_vocab}": dict(graphs=True, draft_vocab=ids)}
    for name, kw in modes.items():
        d = MTPDrafter(model, cfg, k_max=1, max_live=max(batches), max_model_len=args.ctx + 8, **kw)
        rows = d.draw.head.size
        for b in batches:
            ms = time_step(d, b, args.ctx, args.reps, device)
            roof = mtp_bytes(model, cfg, b, args.ctx, rows) / (ceil["copy_gbps"] * 1e9) * 1e3
            doc["cases"].append({"mode": name, "batch": b, "head_rows": rows, "ms": round(ms, 4),
                                 "roofline_ms": round(roof, 4), "of_roofline": round(roof / ms, 3),
                                 "steps": d.stats()})
            log.info("%s batch %d: %.3f ms (roofline %.3f ms)", name, b, ms, roof)
        del d
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_json(args.json, doc)
    print_table(f"MTP draft step, {args.preset} preset, context {args.ctx}", ceil,
                [("mode", "mode", 22, "s"), ("batch", "batch", 6, "d"), ("head rows", "head_rows", 10, "d"),
                 ("ms", "ms", 9, ".3f"), ("roofline ms", "roofline_ms", 12, ".3f"),
                 ("roofline/ms", "of_roofline", 12, ".2f")], doc["cases"])
    return doc


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
