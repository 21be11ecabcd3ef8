"""Host time hidden by launching ahead: decode tokens/s with the next step launched from the
device's outputs (runtime/lookahead.py: greedy and sampled decoding; runtime/spec_ahead.py: greedy
speculation) against the same engine stepping synchronously, and against the ceiling measured in
the same run: the step's GPU time alone (its graph replayed back to back) per token it yields.

    PYTHONPATH=. python benchmarks/ahead.py --json $OUT/ahead.json                  # H200, ~2 min
    PYTHONPATH=. python benchmarks/ahead.py --preset tiny --device cpu --quick      # CPU smoke

The model is built on the device with random weights (the medium preset: K3's per-layer
dimensions). Cases per batch: greedy, sampled (temperature 0.8, seeded), greedy speculation (K
drafts) with an oracle drafter that proposes the target's own greedy continuation and corrupts
each draft with probability 1 - alpha (table lookups on the host, or on the device for the
overlapped step: free drafting, the engine's ceiling), and greedy speculation drafted by the
model's MTP layer (random weights reject its drafts, so that row shows what a draft step costs and
what the overlap hides, not a speedup; runtime/mtp_ahead.py drafts on the device). Each runs
synchronously ("sync") and launching ahead ("ahead"); decode figures time the steps after every
request has its first token. ceiling tok/s = batch x tokens per step (1, or the measured accepted
length + 1) / the step's GPU time; host ms = sync - ahead mean step time, the host time the
overlap hid.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch
from harness import best_s, machine, median_ms, print_table, record, write_json  # benchmarks/ is on sys.path

from k3trt.config import ModelConfig
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities, pick
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.spec_ahead import to_device
from k3trt.runtime.speculative import Drafter, Proposal

log = logging.getLogger("ahead")
VOCAB = 129408


class Oracle(Drafter):
    """The target's greedy continuation (`refs`: request id -> its reference outputs), each draft
    replaced by another token with probability 1 - alpha; on the host."""
    name = "oracle"

    def __init__(self, refs: dict[str, tuple[int, list[int]]], alpha: float, vocab: int, device: torch.device):
        self.refs, self.alpha, self.vocab = refs, alpha, vocab
        self.rng = random.Random(0)
        width = max(len(r) for _, r in refs.values()) + 16
        self.row = {rid: i for i, rid in enumerate(refs)}
        self.table = torch.tensor([r + [0] * (width - len(r)) for _, r in refs.values()], device=device)
        self.gen = torch.Generator(device=device).manual_seed(0)

    def propose(self, inputs, k):
        out = []
        for inp in inputs:
            n_prompt, ref = self.refs[inp.request_id]
            g = len(inp.token_ids) - n_prompt
            out.append([t if self.rng.random() < self.alpha else (t + 1) % self.vocab
                        for t in ref[g:g + inp.limit(k)]])
        return Proposal(out, [None] * len(out))


class DeviceOracle(Oracle):
    """The same drafts made on the device (spec_ahead.DeviceDrafter)."""

    def propose_on_device(self, reqs, bonus, hidden, num_accepted, k):
        meta = to_device([self.row[r.request_id] for r in reqs] + [r.num_output for r in reqs], bonus.device)
        rows, base = meta[:len(reqs)], meta[len(reqs):]
        K = max(k)
        at = (base + num_accepted + 1)[:, None] + torch.arange(K, device=bonus.device)
        d = self.table[rows[:, None], at.clamp(max=self.table.shape[1] - 1)]
        keep = torch.rand(d.shape, generator=self.gen, device=d.device) < self.alpha
        return torch.where(keep, d, (d + 1) % self.vocab)


def make_llm(model, a, *, spec: str = "none") -> LLM:
    k = a.spec_tokens if spec != "none" else 0
    caps = Capacities.plan(max_batch=max(a.batches), max_num_tokens=a.max_num_tokens, spec_tokens=k,
                           verify=sorted(set(a.batches)))
    build = BuildConfig(dtype=a.dtype, block_size=64, max_num_tokens=a.max_num_tokens, max_seq_len=a.max_seq_len)
    return LLM.from_model(model, build=build, capacities=caps, prefix_caching=False, cuda_graphs=True,
                          speculative=spec, spec_tokens=k or None, adaptive_k=False,
                          kv_cache_memory=a.kv_cache_gb << 30)


def drive(llm: LLM, ps: list[list[int]], params: SamplingParams) -> dict:
    """Run the prompts (ids b0, b1, ...); time the steps after every request has its first token
    (synchronised once at each end, not per step: a per-step wait would undo the overlap)."""
    ids = [llm.add_request(p, params, request_id=f"b{i}") for i, p in enumerate(ps)]
    outs, steps, t0, start_tokens = {}, 0, None, 0
    s0 = llm.stats()["speculative"]
    while llm.has_unfinished():
        if t0 is None and all(i in outs for i in ids):
            sync(llm)
            t0, start_tokens = time.perf_counter(), sum(len(o.token_ids) for o in outs.values())
        for o in llm.step():
            outs[o.request_id] = o
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
        steps += t0 is not None
    sync(llm)
    wall = time.perf_counter() - t0 if t0 is not None else 0.0
    s1 = llm.stats()["speculative"]
    vsteps, acc = (s1.get(k, 0) - s0.get(k, 0) for k in ("verify_steps", "accepted_tokens"))
    return {"outputs": [outs[i].token_ids for i in ids], "decode_s": wall, "steps": steps,
            "tokens": sum(len(o.token_ids) for o in outs.values()) - start_tokens,
            "accepted_length": (acc + vsteps) / vsteps if vsteps else None}


def sync(llm: LLM) -> None:
    """Wait for everything launched so far (a step launched ahead too)."""
    if llm.session.device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(llm: LLM, batch: int, q: int) -> float:
    """The GPU time of one (batch capacity, q rows) step alone: its graph replayed back to back."""
    s = llm.session
    st = s.steps[(pick(s.capacities, batch, "verify"), q)]
    if st.graph is not None:
        return median_ms(st.graph.replay, warmup=3, reps=20)
    return best_s(lambda: s._run_static(st)) * 1e3


def case(name: str, llm: LLM, ps, params, *, batch: int, q: int, ahead: tuple, **meta) -> dict:
    """One case twice: `ahead` is (set up synchronous, set up ahead) for the engine."""
    row = {"case": name, "batch": batch, **meta}
    for label, setup in zip(("sync", "ahead"), ahead):
        setup()
        drive(llm, ps[:2], params)                                  # warm: shapes, allocator
        before = llm.stats()["launched_ahead"]
        r = drive(llm, ps, params)
        row[f"{label}_tok_s"] = round(r["tokens"] / r["decode_s"], 1) if r["decode_s"] else None
        row[f"{label}_step_ms"] = round(r["decode_s"] * 1e3 / max(r["steps"], 1), 4)
        row[f"{label}_launched_ahead"] = llm.stats()["launched_ahead"] - before
        row[f"{label}_outputs"] = r["outputs"]
        row["accepted_length"] = r["accepted_length"]
    per_step = batch * ((row["accepted_length"] or 1.0) if q > 1 else 1.0)
    row["gpu_step_ms"] = round(step_ms(llm, batch, q), 4)
    row["ceiling_tok_s"] = round(per_step / row["gpu_step_ms"] * 1e3, 1)
    row["host_ms_hidden"] = round(row["sync_step_ms"] - row["ahead_step_ms"], 4)
    row["same_tokens"] = row.pop("sync_outputs") == row.pop("ahead_outputs")
    log.info("%s", {k: v for k, v in row.items()})
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="smoke settings: small batches, few tokens")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--alphas", default="0.8,1.0")
    ap.add_argument("--max-num-tokens", type=int, default=4096)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gb", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.prompt_len, a.max_tokens, a.max_num_tokens, a.max_seq_len, a.kv_cache_gb = "1,4", 8, 12, 64, 128, 1
    a.batches = [int(x) for x in a.batches.split(",")]
    alphas = [float(x) for x in a.alphas.split(",")]
    device = torch.device(a.device)
    a.dtype = "bf16" if device.type == "cuda" else "fp32"
    doc = record(__file__, argv, machine=machine(device), preset=a.preset, settings={
        k: v for k, v in vars(a).items() if k != "json"}, cases=[])

    cfg = ModelConfig.from_dict(preset_config(a.preset, VOCAB))
    model = build_model(cfg, dtype=BuildConfig(dtype=a.dtype).torch_dtype, device=device)
    init_random_(model, 0, device=device)
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    sampled = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, temperature=0.8, seed=1)

    plain = make_llm(model, a)
    refs = {}
    for b in a.batches:
        ps = torch.randint(16, cfg.vocab_size - 16, (b, a.prompt_len), generator=g).tolist()

        def switch(on: bool, llm=plain):
            return lambda: setattr(llm.loop.lookahead, "possible", on)
        doc["cases"].append(case("greedy", plain, ps, greedy, batch=b, q=1, ahead=(switch(False), switch(True))))
        doc["cases"].append(case("sampled", plain, ps, sampled, batch=b, q=1, ahead=(switch(False), switch(True))))
        refs[b] = (ps, drive(plain, ps, greedy)["outputs"])
        write_json(a.json, doc)
    plain.close()

    spec = make_llm(model, a, spec="ngram")
    for b in a.batches:
        ps, outs = refs[b]
        table = {f"b{i}": (len(p), o) for i, (p, o) in enumerate(zip(ps, outs))}
        for alpha in alphas:
            def drafter(cls, alpha=alpha):
                return lambda: setattr(spec.spec, "drafter", cls(table, alpha, cfg.vocab_size, device))
            doc["cases"].append(case(f"spec a{alpha}", spec, ps, greedy, batch=b, q=a.spec_tokens + 1,
                                     alpha=alpha, ahead=(drafter(Oracle), drafter(DeviceOracle))))
            write_json(a.json, doc)
    spec.close()

    mtp = make_llm(model, a, spec="mtp")       # MTPAhead: the real MTP layer drafts, on the host or the device
    both = mtp.spec.drafter
    for b in a.batches:
        ps = refs[b][0]

        def use(d):
            return lambda: setattr(mtp.spec, "drafter", d)
        doc["cases"].append(case("mtp", mtp, ps, greedy, batch=b, q=a.spec_tokens + 1,
                                 ahead=(use(both.inner), use(both))))
        write_json(a.json, doc)
    mtp.close()
    print_table(f"launching ahead: {a.preset} preset, K={a.spec_tokens}, prompt {a.prompt_len}, "
                f"{a.max_tokens} tokens; {doc['machine']['device']}", None, [
                    ("case", "case", 12, "s"), ("batch", "batch", 5, "d"), ("sync tok/s", "sync_tok_s", 11, ".1f"),
                    ("ahead tok/s", "ahead_tok_s", 11, ".1f"), ("ahead/sync", "ratio:ahead_tok_s/sync_tok_s", 10, ".3f"),
                    ("ceil tok/s", "ceiling_tok_s", 11, ".1f"), ("ahead/ceil", "ratio:ahead_tok_s/ceiling_tok_s", 10,
                                                                 ".3f"),
                    ("host ms", "host_ms_hidden", 8, ".3f"), ("acc len", "accepted_length", 7, ".2f"),
                    ("same", "same_tokens", 5, "s")], doc["cases"],
                note="ceiling: the step's graph replayed back to back x tokens per step; host ms: sync - ahead "
                     "mean step; same: sync and ahead gave the same tokens")
    write_json(a.json, doc)
    return doc


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("k3trt.model.checkpoint_io", "k3trt.runtime.kv_cache", "k3trt.runtime.llm", "k3trt.runtime.engine"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    main()
