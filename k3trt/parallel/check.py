"""The greedy equivalence check behind the parallel tests and the multi-GPU runs: the same prompts
through a fixed schedule, once per rank under a ParallelConfig and once on one process; the greedy
tokens must be equal and the logits close.

Schedule (two sequences, prompt lengths 13 and 7 by default), every step's logits recorded:
  1. q = (9, 7)      chunked prefill of seq 0 beside all of seq 1 (uneven: per-sequence paths);
                     the MTP layer runs on this step too (hidden[t] with token t+1)
  2. q = (4, 1)      the rest of seq 0's prompt beside seq 1's first decode
  3. q = (1, 1) × decode_steps
  4. q = (K+1, K+1)  speculative verification of K fixed drafts, KDA states kept per position;
                     greedy acceptance, then the KDA state rolled back to the accepted length
  5. q = (1, 1) × decode_steps
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3trt.model.context import StepContext
from k3trt.model.loader import load_model
from k3trt.parallel.cache import allocate_cache, dcp_slot_mapping
from k3trt.parallel.comm import Comm, TorchComm
from k3trt.parallel.config import ParallelConfig
from k3trt.testing import assert_close

BLOCK = 16


@dataclass
class Trace:
    tokens: list[list[int]] = field(default_factory=list)      # per sequence: greedy tokens
    logits: list[torch.Tensor] = field(default_factory=list)   # per step: fp32 [rows, vocab], CPU
    mtp_logits: torch.Tensor | None = None
    accepted: list[int] = field(default_factory=list)          # per sequence, at the verify step
    seconds: float = 0.0


def make_prompts(vocab_size: int, lens: tuple[int, ...] = (13, 7), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=g) for n in lens]


@torch.no_grad()
def greedy_trace(model, comm: Comm, prompts: list[torch.Tensor], *, decode_steps: int = 2,
                 spec_tokens: int = 3, device: str | torch.device = "cpu", seed: int = 1) -> Trace:
    """Run the schedule of the module doc on `model` (rank comm.pc.rank's shard) and record it."""
    cfg, pc = model.cfg, comm.pc
    S, K = len(prompts), spec_tokens
    if S != 2 or len(prompts[0]) <= 9 or len(prompts[1]) != 7:
        raise ValueError("the schedule is written for two prompts of lengths > 9 and 7")
    max_len = max(len(p) for p in prompts) + 2 * decode_steps + K + 4
    max_blocks = -(-max_len // BLOCK)
    table = torch.arange(S * max_blocks, dtype=torch.int32).view(S, max_blocks)
    dtype = next(model.parameters()).dtype
    cache = allocate_cache(cfg, pc, num_blocks=S * max_blocks, block_size=BLOCK, num_slots=S,
                           max_q=K + 1, dtype=dtype, device=device)
    hist = [p.tolist() for p in prompts]        # every known token: prompt, then committed output
    done = [0] * S                              # tokens already in the caches
    g = torch.Generator().manual_seed(seed)
    trace = Trace(tokens=[[] for _ in range(S)])
    t0 = time.perf_counter()

    def run(q_lens, save=False, rows=None):
        rows = rows or [hist[i][done[i]:done[i] + q] for i, q in enumerate(q_lens)]
        ctx = StepContext(tuple(q_lens), tuple(done), dcp_slot_mapping(done, q_lens, table, BLOCK, pc).to(device),
                          table.to(device), torch.arange(S, device=device), save)
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)
        h = model(ids, ctx, cache)
        logits = model.logits(h).cpu()
        trace.logits.append(logits)
        return h, ctx, logits.split(list(q_lens))

    def emit(i, tok):
        hist[i].append(tok)
        trace.tokens[i].append(tok)

    # 1. chunked prefill beside a whole prompt, and the MTP layer on the same positions
    q = (9, len(prompts[1]))
    h, ctx, per = run(q)
    emit(1, int(per[1][-1].argmax()))
    nxt = torch.tensor([t for i in range(S) for t in hist[i][done[i] + 1:done[i] + q[i] + 1]], device=device)
    trace.mtp_logits = model.mtp(0, h, nxt, ctx, cache)[1].cpu()
    done = [d + n for d, n in zip(done, q)]
    # 2. the rest of seq 0's prompt beside a decode; 3. decodes
    for q in [(len(prompts[0]) - 9, 1)] + [(1, 1)] * decode_steps:
        _, _, per = run(q)
        for i in range(S):
            emit(i, int(per[i][-1].argmax()))
        done = [d + n for d, n in zip(done, q)]
    # 4. verification of K fixed drafts: accept the longest greedy-matching prefix, roll back
    drafts = [torch.randint(1, cfg.vocab_size, (K,), generator=g).tolist() for _ in range(S)]
    rows = [[hist[i][done[i]]] + drafts[i] for i in range(S)]
    _, _, per = run((K + 1,) * S, save=True, rows=rows)
    for i in range(S):
        best = per[i].argmax(-1).tolist()
        n = 0
        while n < K and drafts[i][n] == best[n]:
            n += 1
        trace.accepted.append(n)
        for tok in drafts[i][:n] + [best[n]]:
            emit(i, tok)
        for layer in cache.kda.values():
            layer.state[i] = layer.step_state[i, n]
            layer.conv[i] = layer.step_conv[i, n]
        done[i] += n + 1
    # 5. decodes after the rollback
    for _ in range(decode_steps):
        _, _, per = run((1, 1))
        for i in range(S):
            emit(i, int(per[i][-1].argmax()))
        done = [d + 1 for d in done]
    trace.seconds = time.perf_counter() - t0
    return trace


def compare(got: Trace, ref: Trace, *, atol: float, rtol: float, rel_norm: float, name: str = "") -> None:
    """Raise AssertionError unless the tokens are equal and every step's logits are close."""
    if got.tokens != ref.tokens:
        raise AssertionError(f"{name}: greedy tokens differ: {got.tokens} vs single-process {ref.tokens}")
    if got.accepted != ref.accepted:
        raise AssertionError(f"{name}: accepted drafts differ: {got.accepted} vs {ref.accepted}")
    for k, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        assert_close(a, b, atol=atol, rtol=rtol, rel_norm=rel_norm, name=f"{name} step {k} logits")
    assert_close(got.mtp_logits, ref.mtp_logits, atol=atol, rtol=rtol, rel_norm=rel_norm, name=f"{name} MTP logits")


def worker(rank: int, ckpt: str, layouts: list[dict], out_dir: str, device: str = "cpu",
           dtype: torch.dtype = torch.float32) -> None:
    """One rank (torch.distributed already initialised): for each layout (ParallelConfig fields but
    rank), load this rank's shard of `ckpt`, run the schedule, save the Trace to
    ``out_dir/{i}.rank{rank}.pt``. Every rank runs every layout, in order."""
    for i, fields in enumerate(layouts):
        comm = TorchComm(ParallelConfig(**fields, rank=rank))
        cfg, model = load_model(ckpt, dtype=dtype, device=device, comm=comm)
        trace = greedy_trace(model, comm, make_prompts(cfg.vocab_size), device=device)
        torch.save(trace.__dict__, Path(out_dir) / f"{i}.rank{rank}.pt")
        del model


def load_trace(path: str | Path) -> Trace:
    return Trace(**torch.load(path, weights_only=False))
