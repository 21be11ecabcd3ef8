"""Real acceptance figures from a small K3-architecture model trained here, on this machine's own
Python sources: n-gram, MTP and layer-skip drafting, their acceptance and end-to-end speedup
through LLM. The model is small and trained for minutes: its figures show what k3trt's drafters
do with a model that has learnt something, not what Kimi K3 gets.

    PYTHONPATH=. python benchmarks/train_draft.py --json $OUT/spec_trained.json        # H200, ~5 min
    PYTHONPATH=. python benchmarks/train_draft.py --device cpu --steps 5 --tiny        # CPU smoke

  data      the standard library's .py files (sysconfig's stdlib path), shuffled by a seed; one in
            ten (by a hash of its path) held out for evaluation; tokenized with the repo's K3
            tokenizer (a worker pool), files joined by EOS
  model     the ``small`` preset (KDA + MLA, latent MoE, AttnRes, one MTP layer; --tiny: ``tiny``)
            initialised as random checkpoints are, trained with AdamW under bf16 autocast for
            --train-s seconds (or --steps) through benchmarks/k3_train.py's differentiable forward:
            next-token loss + 0.5 x the MTP layer's next-next-token loss + 0.3 x the next-token
            loss after the first --skip-layers layers (so that layer-skip drafts)
  save      a k3trt checkpoint (checkpoint_tensors + write_checkpoint, the tokenizer, config.json)
  evaluate  held-out loss and teacher-forced top-1 accuracy (target, MTP, layer-skip); then the
            checkpoint loaded back and run through LLM.from_model on held-out prompts (greedy,
            EOS ignored) without drafts and with ngram, mtp and layerskip:N: tokens/s, speedup,
            acceptance rate, mean accepted length, and whether the output equals plain greedy

The table's title gives the device and its ceilings (harness.py), measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import random
import sysconfig
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import k3_train
from harness import cpu_ceilings, machine, measure, print_table, record, write_json

from k3trt.config import ModelConfig
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.loader import build_model, load_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import checkpoint_tensors, init_random_
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.tokenizer import Tokenizer, write_k3_tokenizer

log = logging.getLogger("train_draft")
NOTE = ("a small K3-architecture model trained here for minutes on Python sources: its acceptance shows what "
        "k3trt's drafters do with a model that has learnt something, not what Kimi K3 gets")
MODES = ("none", "ngram", "mtp", "layerskip")


# ------------------------------------------------------------------------------ data
@functools.lru_cache(maxsize=1)
def _tokenizer(tok_dir: str) -> Tokenizer:
    """One tokenizer per worker process, loaded on its first file."""
    return Tokenizer.from_dir(tok_dir)


def _encode(job: tuple[str, str]) -> list[int]:
    tok_dir, path = job
    return _tokenizer(tok_dir).encode(Path(path).read_text(errors="replace"))


def corpus(tok_dir: Path, eos: int, max_mb: float, seed: int, workers: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train ids, held-out ids, facts): the stdlib's .py files, one in ten held out by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(f) for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file())
    random.Random(seed).shuffle(files)
    held = [f for f in files if zlib.crc32(f.encode()) % 10 == 0]
    train = [f for f in files if zlib.crc32(f.encode()) % 10 != 0]
    budget = max_mb * 1e6

    def take(fs, limit):
        out, size = [], 0
        for f in fs:
            if size >= limit:
                break
            out.append(f)
            size += Path(f).stat().st_size
        return out
    train, held = take(train, budget), take(held, budget / 10)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        enc = list(pool.map(_encode, [(str(tok_dir), f) for f in train + held], chunksize=8))

    def join(seqs):
        return torch.tensor([t for s in seqs for t in (*s, eos)], dtype=torch.int64)
    tr, ho = join(enc[:len(train)]), join(enc[len(train):])
    facts = {"source": str(root), "train_files": len(train), "held_out_files": len(held), "train_tokens": len(tr),
             "held_out_tokens": len(ho), "tokenize_s": round(time.perf_counter() - t0, 2)}
    log.info("corpus: %s", facts)
    return tr, ho, facts


def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


# ------------------------------------------------------------------------------ training
def losses(model, ids: torch.Tensor, skip: int) -> dict[str, torch.Tensor]:
    """Cross-entropies (and top-1 accuracies, detached) of the target, its MTP layer and its first
    `skip` layers on ids [B, T]."""
    B, T = ids.shape
    hidden, early = k3_train.forward(model, ids, exit_after=skip)
    nxt = ids[:, 1:].reshape(-1)
    main = k3_train.logits(model, hidden).view(B, T, -1)[:, :-1].reshape(B * (T - 1), -1)
    mtp = k3_train.mtp(model, hidden, ids).view(B, T - 1, -1)[:, :-1].reshape(B * (T - 2), -1)
    ee = k3_train.logits(model, early).view(B, T, -1)[:, :-1].reshape(B * (T - 1), -1)
    nn2 = ids[:, 2:].reshape(-1)
    out = {"main": F.cross_entropy(main, nxt), "mtp": F.cross_entropy(mtp, nn2), "skip": F.cross_entropy(ee, nxt)}
    with torch.no_grad():
        out |= {"acc_main": (main.argmax(-1) == nxt).float().mean(), "acc_mtp": (mtp.argmax(-1) == nn2).float().mean(),
                "acc_skip": (ee.argmax(-1) == nxt).float().mean()}
    return out


def train(model, data: torch.Tensor, a, device: torch.device) -> dict:
    params = [p for n, p in model.named_parameters() if not n.endswith("e_score_correction_bias")]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed)
    it = batches(data, a.batch, a.seq_len, gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    t0, step, hist = time.perf_counter(), 0, []
    model.train()
    while step < a.steps and time.perf_counter() - t0 < a.train_s:
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (time.perf_counter() - t0) / a.train_s))))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = next(it).to(device)
        with autocast:
            ls = losses(model, ids, a.skip_layers)
            loss = ls["main"] + 0.5 * ls["mtp"] + 0.3 * ls["skip"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            row = {k: round(float(v.detach()), 4) for k, v in ls.items()} | {"step": step, "lr": round(lr, 6),
                                                                    "s": round(time.perf_counter() - t0, 1)}
            hist.append(row)
            log.info("step %d (%.0fs): loss %.3f, mtp %.3f, skip %.3f; acc %.3f / %.3f / %.3f", step, row["s"],
                     row["main"], row["mtp"], row["skip"], row["acc_main"], row["acc_mtp"], row["acc_skip"])
    model.eval()
    return {"steps": step, "train_s": round(time.perf_counter() - t0, 1), "tokens": step * a.batch * a.seq_len,
            "history": hist}


@torch.no_grad()
def held_out(model, data: torch.Tensor, a, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(a.seed + 1)
    it = batches(data, a.batch, a.seq_len, gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    sums: dict[str, float] = {}
    for _ in range(a.eval_batches):
        with autocast:
            for k, v in losses(model, next(it).to(device), a.skip_layers).items():
                sums[k] = sums.get(k, 0.0) + float(v.detach()) / a.eval_batches
    return {k: round(v, 4) for k, v in sums.items()} | {"perplexity": round(math.exp(sums["main"]), 2)}


# ------------------------------------------------------------------------------ checkpoint
def save(model, raw: dict, cfg: ModelConfig, tok_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model.to(torch.bfloat16), cfg, "none")
    write_checkpoint(out, {k: v.detach().cpu() for k, v in tensors.items()}, max_shard_bytes=1 << 30)
    for f in tok_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    tok = Tokenizer.from_dir(tok_dir)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return out


# ------------------------------------------------------------------------------ drafting through LLM
def speculation(ckpt: Path, prompts: list[list[int]], a, device: torch.device) -> list[dict]:
    dtype = "bf16" if device.type == "cuda" else "fp32"
    _, model = load_model(ckpt, dtype=BuildConfig(dtype=dtype).torch_dtype, device=device)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    rows, plain = [], {}
    for mode in MODES:
        spec = f"layerskip:{a.skip_layers}" if mode == "layerskip" else mode
        k = a.spec_tokens if mode != "none" else 0
        caps = Capacities.plan(max_batch=max(a.eval_batch_sizes), max_num_tokens=2048, spec_tokens=k,
                               verify=sorted(set(a.eval_batch_sizes)))
        build = BuildConfig(dtype=dtype, block_size=64, max_num_tokens=2048, max_seq_len=1024)
        llm = LLM.from_model(model, build=build, capacities=caps, tokenizer_dir=ckpt, prefix_caching=False,
                             speculative=spec, spec_tokens=k or None, kv_cache_memory=1 << 30)
        try:
            for b in a.eval_batch_sizes:
                llm.generate(prompts[:b], SamplingParams(max_tokens=4, ignore_eos=True))     # warm-up
                s0 = llm.stats()["speculative"]
                t0, outs = time.perf_counter(), []
                for i in range(0, len(prompts), b):
                    outs += [o.token_ids for o in llm.generate(prompts[i:i + b], params)]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                s1 = llm.stats()["speculative"]
                drafted = s1.get("drafted_tokens", 0) - s0.get("drafted_tokens", 0)
                acc = s1.get("accepted_tokens", 0) - s0.get("accepted_tokens", 0)
                vsteps = s1.get("verify_steps", 0) - s0.get("verify_steps", 0)
                tokens = sum(map(len, outs))
                row = {"name": f"{spec} b{b}", "mode": mode, "speculative": spec, "spec_tokens": k, "batch": b,
                       "tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 1),
                       "acceptance_rate": round(acc / drafted, 4) if drafted else None,
                       "mean_accepted_length": round((acc + vsteps) / vsteps, 3) if vsteps else None,
                       "drafted_tokens": drafted}
                if mode == "none":
                    plain[b] = row | {"outputs": outs}
                else:
                    row["speedup"] = round(row["tokens_per_s"] / plain[b]["tokens_per_s"], 3)
                    row["exact"] = outs == plain[b]["outputs"]
                rows.append(row)
                log.info("%s: %s", row["name"], {k: row.get(k) for k in ("tokens_per_s", "speedup", "acceptance_rate")})
        finally:
            llm.close()
    return rows


def eval_prompts(data: torch.Tensor, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length - 1, (n,), generator=g).tolist()
    return [data[s:s + length].tolist() for s in starts]


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset, little data (CPU smoke)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-mb", type=float, default=16.0, help="training text, MB")
    ap.add_argument("--workers", type=int, default=8, help="tokenizer processes")
    ap.add_argument("--train-s", type=float, default=200.0)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--skip-layers", type=int, default=2, help="layer-skip draft depth (trained as an early exit)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--eval-batch-sizes", default="1,8")
    ap.add_argument("--out", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.max_mb, a.batch, a.seq_len, a.eval_batches, a.prompts, a.prompt_len, a.max_tokens = 0.3, 2, 64, 1, 2, 24, 8
        a.eval_batch_sizes, a.log_every, a.workers, a.skip_layers = "1,2", 1, 2, 2
    a.eval_batch_sizes = [int(x) for x in a.eval_batch_sizes.split(",") if x]
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    print(f"NOTE: {NOTE}", flush=True)
    doc = record(__file__, argv, note=NOTE, machine=machine(device),
                 settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()})
    work = Path(tempfile.mkdtemp(prefix="train_draft."))
    tok_dir = work / "tokenizer"
    write_k3_tokenizer(tok_dir)
    tok = Tokenizer.from_dir(tok_dir)
    vocab = -(-tok.vocab_size // 128) * 128
    # the tokenizer's worker processes fork before CUDA is initialised (the ceilings initialise it)
    train_ids, held_ids, doc["data"] = corpus(tok_dir, tok.eos_token_id, a.max_mb, a.seed, a.workers)
    doc["machine"]["ceilings"] = measure() if device.type == "cuda" else cpu_ceilings()
    raw = preset_config("tiny" if a.tiny else "small", vocab, pad_token_id=tok.pad_token_id)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, dtype=torch.float32, device=device)
    init_random_(model, a.seed, device=device)
    doc["model"] = {"preset": "tiny" if a.tiny else "small", "params": sum(p.numel() for p in model.parameters()),
                    "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                    "vocab": vocab}
    log.info("model: %s preset, %.1fM parameters, training on %s", doc["model"]["preset"], doc["model"]["params"] / 1e6,
             device)
    doc["training"] = train(model, train_ids, a, device)
    write_json(a.json, doc)
    doc["held_out"] = held_out(model, held_ids, a, device)
    log.info("held out: %s", doc["held_out"])
    ckpt = save(model, raw, cfg, tok_dir, a.out or work / "checkpoint")
    doc["checkpoint"] = str(ckpt)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    doc["cases"] = speculation(ckpt, eval_prompts(held_ids, a.prompts, a.prompt_len, a.seed + 2), a, device)
    for c in doc["cases"]:
        c.pop("outputs", None)
    write_json(a.json, doc)
    h = doc["held_out"]
    print_table(f"train_draft: {NOTE}.\nHeld out: loss {h['main']} (perplexity {h['perplexity']}), top-1 next token "
                f"{h['acc_main']}, MTP next-next {h['acc_mtp']}, layer-skip:{a.skip_layers} next {h['acc_skip']}; "
                f"{doc['training']['steps']} steps, {doc['training']['tokens'] / 1e6:.1f}M tokens in "
                f"{doc['training']['train_s']}s", doc["machine"]["ceilings"],
                [("case", "name", 16, ""), ("tok/s", "tokens_per_s", 9, ".1f"), ("speedup", "speedup", 7, ".2f"),
                 ("accept", "acceptance_rate", 7, ".3f"), ("acc len", "mean_accepted_length", 7, ".2f"),
                 ("drafted", "drafted_tokens", 8, "d"), ("exact", "exact", 5, "")], doc["cases"],
                note=f"K={a.spec_tokens}; greedy, {a.prompts} held-out prompts of {a.prompt_len} tokens, "
                     f"max_tokens {a.max_tokens}; acc len: tokens per verify step")
    return doc


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("k3trt.model.checkpoint_io", "k3trt.runtime.kv_cache", "k3trt.runtime.llm",
                  "k3trt.model.checkpoint_write"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    main()
