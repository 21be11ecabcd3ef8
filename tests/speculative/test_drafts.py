"""Cheaper and better model drafts (speculative/mtp.py, draft_vocab.py, draw.py):

- MTP after a prefix-cache resume drafts from a window that starts at the resume point: its drafts
  are the MTP layer run on the window at the true positions (an oracle that places them there),
  and through the runtime a resumed request gets drafts and still decodes exactly as plain greedy;
- a reduced draft vocabulary: make_draft_vocab / counts files; the reduced head's logits are the
  full head's columns; drafts come only from the reduced set; q is a distribution over all ids
  that is 0 off the set; greedy output through the runtime equals plain greedy;
- MTP draft steps through static steps (CUDA graphs on the GPU; the same padded path uncaptured on
  the CPU) equal the eager steps.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from click.testing import CliRunner
from runtime_utils import BLOCK, assert_released, build_tiny_engine, prompts

from k3trt.cli import main as cli
from k3trt.model.context import ModelCache, StepContext
from k3trt.model.loader import load_model
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.speculative import DraftInput, make_drafter
from k3trt.runtime.speculative.draft_model import DraftModelDrafter, SeqStep
from k3trt.runtime.speculative.draft_vocab import (DraftHead, count_tokens, draft_vocab_ids, load_token_counts,
                                                  make_draft_vocab, save_token_counts)
from k3trt.runtime.speculative.mtp import MTPDrafter
from k3trt.testing import assert_close


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def target_hidden(model, cfg, ids: list[int]) -> torch.Tensor:
    T, nb = len(ids), -(-len(ids) // BLOCK)
    cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=BLOCK, num_slots=1, layers=range(cfg.num_hidden_layers))
    ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None], torch.tensor([0]))
    with torch.inference_mode():
        return model(torch.tensor(ids), ctx, cache)


def mtp_window_oracle(model, cfg, prev: torch.Tensor, next_ids: list[int], first: int):
    """K3ForCausalLM.mtp over rows at true positions first.. that attend only to each other."""
    T, nb, L = len(next_ids), -(-len(next_ids) // BLOCK), cfg.num_hidden_layers
    cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=BLOCK, num_slots=1, layers=range(L, L + 1))
    ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None], torch.tensor([0]),
                      dev_positions=torch.arange(first, first + T))
    with torch.inference_mode():
        return model.mtp(0, prev, torch.tensor(next_ids), ctx, cache)


# ------------------------------------------------------------------------------ MTP after a resume
@pytest.mark.parametrize("start", [16, 23])
def test_mtp_window_after_a_prefix_hit(tiny_model, start):
    cfg, model = tiny_model
    (a,) = prompts(8, [30])
    P = len(a)
    x = int(model.logits(target_hidden(model, cfg, a)[-1:]).argmax())
    hid = target_hidden(model, cfg, a + [x])
    A = MTPDrafter(model, cfg, k_max=3, max_live=2, max_model_len=128, sample_drafts=True)
    A.on_hidden("r", start, hid[start:P])            # the prefill of the uncached tail only
    prop = A.propose([DraftInput("r", a + [x], params=SamplingParams(temperature=1.0))], 3)
    d = prop.tokens[0]
    assert len(d) == 3
    with torch.inference_mode():
        prev, ids = model.model.norm(hid[start:P]), (a + [x])[start + 1:]
    for j in range(3):
        g, logits = mtp_window_oracle(model, cfg, prev, ids, start)
        assert_close(prop.probs[0][j], torch.softmax(logits[-1], -1), atol=1e-6, rtol=1e-3, name=f"q_{j}")
        prev, ids = torch.cat([prev, g[-1:]]), ids + [d[j]]
    # the window grows with the hand-overs: accept d_1, reject d_2 -> drafts equal a drafter that
    # got the same window in one hand-over
    hist = a + [x, d[0], (d[1] + 1) % 1000]
    hid2 = target_hidden(model, cfg, hist)
    A.draw.sample_drafts = False
    A.on_commit("r", hist[P + 1:])
    A.on_hidden("r", P, hid2[P:P + 2])
    B = MTPDrafter(model, cfg, k_max=3, max_live=2, max_model_len=128)
    B.on_hidden("r", start, hid2[start:P + 2])
    assert A.propose([DraftInput("r", hist)], 3).tokens == B.propose([DraftInput("r", hist)], 3).tokens
    A.release("r")
    assert not A.seqs and len(A.blocks.free) == len(B.blocks.free) + len(B.seqs["r"].blocks)


def test_mtp_drafts_after_a_prefix_cache_resume(engine):
    """A request whose prompt the prefix cache served gets MTP drafts and decodes as plain greedy."""
    base = prompts(31, [40])[0]
    ps = [base, base[:36] + [7, 8, 9]]           # the second shares two full blocks with the first
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(engine, verify_checksums=False).generate(ps, params)]
    llm = LLM(engine, verify_checksums=False, speculative="mtp", spec_tokens=2, prefix_caching=True)
    first = llm.generate(ps[:1], params)[0]
    second = llm.generate(ps[1:], params)[0]
    assert [first.token_ids, second.token_ids] == want
    assert second.stats["cached_tokens"] == 32
    assert second.stats["drafted_tokens"] > 0
    assert_released(llm)


# ------------------------------------------------------------------------------ reduced vocabulary
def test_make_draft_vocab_and_counts_files(tmp_path):
    counts = torch.tensor([5, 0, 9, 5, 1])
    assert make_draft_vocab(counts, 3).tolist() == [2, 0, 3]           # ties: the lower id first
    assert make_draft_vocab([4, 4, 2, 4, 2, 0], 2, vocab_size=5, corpus=True).tolist() == [4, 2]
    with pytest.raises(ValueError, match="1..5"):
        make_draft_vocab(counts, 6)
    with pytest.raises(ValueError, match="corpus ids"):
        make_draft_vocab([9], 1, vocab_size=5, corpus=True)
    (tmp_path / "c.json").write_text(json.dumps({"3": 7, "1": 2}))
    assert load_token_counts(tmp_path / "c.json", 5).tolist() == [0, 2, 0, 7, 0]
    (tmp_path / "c.txt").write_text("1\n8\n\n3\n")
    assert draft_vocab_ids(2, tmp_path / "c.txt", 4).tolist() == [1, 2]
    assert draft_vocab_ids(3, None, 10).tolist() == [0, 1, 2]            # merge order
    counted = count_tokens([[1, 2, 2], [], [4, 2]], 5)
    assert counted.tolist() == [0, 1, 3, 0, 1]
    save_token_counts(tmp_path / "saved.json", counted)
    assert torch.equal(load_token_counts(tmp_path / "saved.json", 5), counted)
    (tmp_path / "bad.json").write_text("{\"9\": 1}")
    with pytest.raises(ValueError, match="bad.json"):
        load_token_counts(tmp_path / "bad.json", 5)
    (tmp_path / "bad.txt").write_text("x\n")
    with pytest.raises(ValueError, match="one count per line"):
        load_token_counts(tmp_path / "bad.txt", 5)


def test_reduced_head_is_the_full_heads_columns(tiny_model):
    cfg, model = tiny_model
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:300]
    head = DraftHead(model.lm_head, ids)
    x = torch.randn(5, cfg.hidden_size)
    with torch.inference_mode():
        assert_close(head(x), model.lm_head(x).float()[:, ids], name="reduced logits")
    q = torch.softmax(torch.randn(2, 300), -1)
    full = head.to_full(q, cfg.vocab_size)
    assert_close(full[:, ids], q) and float(full.sum() - q.sum()) == pytest.approx(0, abs=1e-5)
    with pytest.raises(ValueError, match="distinct ids"):
        DraftHead(model.lm_head, torch.tensor([1, 1]))


@pytest.mark.parametrize("kind", ["mtp", "draft"])
def test_drafts_only_from_the_reduced_vocabulary(tiny_model, kind):
    cfg, model = tiny_model
    ids = torch.arange(0, cfg.vocab_size, 7)[:500]
    keep = set(ids.tolist())
    kw = dict(k_max=4, max_live=2, max_model_len=128, sample_drafts=True, draft_vocab=ids)
    make = MTPDrafter if kind == "mtp" else DraftModelDrafter
    A, full = make(model, cfg, **kw), make(model, cfg, **{**kw, "draft_vocab": None})
    assert A.stats()["draft_vocab_size"] == 500
    (a,) = prompts(9, [21])
    if kind == "mtp":
        hid = target_hidden(model, cfg, a)
        A.on_hidden("r", 0, hid[:-1])
        full.on_hidden("r", 0, hid[:-1])
    greedy = A.propose([DraftInput("r", a)], 4).tokens[0]
    assert len(greedy) == 4 and set(greedy) <= keep
    # the first draft is the full head's argmax over the kept ids
    q_full = full.propose([DraftInput("r", a, params=SamplingParams(temperature=1.0))], 1).probs[0][0]
    assert greedy[0] == int(ids[q_full[ids].argmax()])
    prop = A.propose([DraftInput("r", a, params=SamplingParams(temperature=1.0), seed=3)], 4)
    q = prop.probs[0]
    assert set(prop.tokens[0]) <= keep and q.shape == (4, cfg.vocab_size)
    off = torch.ones(cfg.vocab_size, dtype=torch.bool)
    off[ids] = False
    assert float(q[:, off].abs().max()) == 0.0
    assert_close(q.sum(-1), torch.ones(4), atol=1e-5, rtol=0)


def test_reduced_vocabulary_greedy_equals_plain(engine, tmp_path):
    ps = prompts(33, [18, 25])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(engine, verify_checksums=False).generate(ps, params)]
    counts = [0] * 1000 + [1] * 10
    (tmp_path / "counts.json").write_text(json.dumps(counts))
    for spec, source in (("mtp", None), (f"draft:{engine / 'rank0'}", tmp_path / "counts.json")):
        llm = LLM(engine, verify_checksums=False, speculative=spec, spec_tokens=3, draft_vocab_size=1000,
                  draft_vocab_counts=source)
        assert [o.token_ids for o in llm.generate(ps, params)] == want, spec
        assert llm.stats()["speculative"]["drafter"]["draft_vocab_size"] == 1000
        assert_released(llm)


def test_draft_vocab_on_the_command_line(engine, tmp_path):
    counts = tmp_path / "counts.txt"
    counts.write_text("\n".join(str(i % 7) for i in range(1000)))
    r = CliRunner().invoke(cli, ["run", str(engine), "-p", "hello", "--max-tokens", "6", "--speculative", "mtp",
                                 "--draft-vocab", "300", "--draft-vocab-counts", str(counts), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["stats"]["speculative"]["drafter"]["draft_vocab_size"] == 300
    r = CliRunner().invoke(cli, ["run", str(engine), "-p", "hello", "--speculative", "ngram", "--draft-vocab", "3"])
    assert r.exit_code != 0 and "draft_vocab_size" in r.output


def test_draft_vocab_option_is_checked(engine):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        LLM(engine, verify_checksums=False, speculative="ngram", draft_vocab_size=100)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        make_drafter("mtp", k=2, max_live=1, max_model_len=64, draft_vocab_size=0, target=None)


# ------------------------------------------------------------------------------ MTP static steps
def test_mtp_static_steps_equal_eager(tiny_model):
    """The padded static MTP steps (graphs=True off CUDA: the graphs' path, uncaptured) propose what
    the eager steps do, for a batch of requests with uneven catch-ups after random rejections."""
    cfg, model = tiny_model
    rng = random.Random(5)
    kw = dict(k_max=3, max_live=4, max_model_len=128, sample_drafts=True)
    A, B = MTPDrafter(model, cfg, graphs=True, **kw), MTPDrafter(model, cfg, graphs=False, **kw)
    hists = prompts(12, [13, 17, 20])
    params = SamplingParams(temperature=1.0)
    for i, h in enumerate(hists):
        hid = target_hidden(model, cfg, h)
        h.append(int(model.logits(hid[-1:]).argmax()))
        for D in (A, B):
            D.on_hidden(f"r{i}", 0, hid)
    for step in range(6):
        ks = [rng.randint(1, 3) for _ in hists]
        inputs = [DraftInput(f"r{i}", h, max_drafts=k, params=params, seed=i) for i, (h, k) in enumerate(zip(hists, ks))]
        got, want = A.propose(inputs, 3), B.propose(inputs, 3)
        assert got.tokens == want.tokens, step
        for i in range(len(hists)):
            assert_close(got.probs[i], want.probs[i], atol=1e-5, rtol=1e-3, name=f"q of r{i} at step {step}")
        for i, (h, d) in enumerate(zip(hists, got.tokens)):
            n = rng.randint(0, len(d))
            rows = target_hidden(model, cfg, h + d[:n])[len(h) - 1:]
            for D in (A, B):
                D.on_hidden(f"r{i}", len(h) - 1, rows)
            h.extend(d[:n] + [rng.randrange(1000)])
    s = A.stats()
    assert s["static_steps"] > 0 and s["eager_steps"] == 1          # only the first catch-up (whole prompts)
    for i in range(len(hists)):
        A.release(f"r{i}")
        B.release(f"r{i}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mtp_graph_step_equals_eager_step(tiny_ckpt, device):
    """One draft step and one uneven catch-up through the graph (captured on CUDA in bf16; the
    static path on the CPU in fp32) against the eager step on the same cache and inputs."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg, model = load_model(tiny_ckpt, dtype=dtype, device=device)
    A = MTPDrafter(model, cfg, k_max=3, max_live=4, max_model_len=128, graphs=True)
    assert A.graphs is not None and A.graphs.capture == (device == "cuda")
    hists = prompts(14, [15, 21, 9])
    for i, h in enumerate(hists):
        with torch.inference_mode():
            A.on_hidden(f"r{i}", 0, torch.randn(len(h) - 1, cfg.hidden_size, dtype=dtype, device=device))
    A.propose([DraftInput(f"r{i}", h) for i, h in enumerate(hists)], 1)     # step 0 over whole prompts: eager
    cases = {"draft step": [SeqStep([h[-1]], len(h) - 1, A.seqs[f"r{i}"].blocks, 0) for i, h in enumerate(hists)],
             "catch-up": [SeqStep(h[-3:][:q], len(h) - 3, A.seqs[f"r{i}"].blocks, 0)
                          for i, (h, q) in enumerate(zip(hists, [3, 1, 2]))]}
    for name, steps in cases.items():
        T = sum(len(s.tokens) for s in steps)
        with torch.inference_mode():
            prev = torch.randn(T, cfg.hidden_size, dtype=dtype, device=device)
            key = A.graphs.fits(steps)
            assert key is not None, name
            g_graph, l_graph = (t.clone() for t in A.graphs.run(key, steps, prev))
            graphs, A.graphs = A.graphs, None
            g_eager, l_eager = A._step(steps, prev)
            A.graphs = graphs
        # a whole MTP layer in bf16 (graph and eager kernels may differ): elementwise bounds widen,
        # the norm bound stays the dtype's
        wide = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else {}
        assert_close(g_graph, g_eager, dtype=dtype, name=f"{name}: g", **wide)
        assert_close(l_graph, l_eager, dtype=dtype, name=f"{name}: logits", **wide)
    for i in range(len(hists)):
        A.release(f"r{i}")


@pytest.mark.gpu
def test_mtp_on_cuda_with_graphs_vocabulary_grammar_and_resume(tiny_ckpt, tmp_path, tok):
    """Everything at once on the GPU in bf16: MTP draft-step graphs, a reduced draft vocabulary,
    grammar-masked drafts and prefix-cache resumes; the first tokens equal plain decoding's (later
    ones may differ by bf16 rounding between verify and decode shapes) and guided text matches."""
    pytest.importorskip("xgrammar")
    engine = build_tiny_engine(tiny_ckpt, tmp_path / "engine", dtype="bf16")
    ps = [tok.encode(f"Example {i}: the quick brown fox jumps over the lazy dog, again and again. " * 3)
          for i in range(3)]
    regex = "[a-z]{2,8}( [a-z]{2,8}){2,5}"
    params = [SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=40, guided={"regex": regex}),
              SamplingParams(max_tokens=16, ignore_eos=True)]
    base = LLM(engine, verify_checksums=False, device="cuda")
    plain = [base.generate([p], q)[0] for p, q in zip(ps, params)]     # the same prefill shapes as below
    base.close()
    llm = LLM(engine, verify_checksums=False, device="cuda", speculative="mtp", spec_tokens=3, draft_vocab_size=4000)
    for p, q, want in zip(ps, params, plain):
        for again in (False, True):                  # the second run resumes from the prefix cache
            o = llm.generate([p], q)[0]
            assert o.token_ids[:1] == want.token_ids[:1]
            assert o.finish_reason != "stop" or re.fullmatch(regex, o.text), o.text
            assert not again or (o.stats["cached_tokens"] > 0 and o.stats["drafted_tokens"] > 0), o.stats
    s = llm.stats()["speculative"]
    assert s["drafter"]["graph_steps"] > 0 and s["drafter"]["masked_drafts"] > 0
    assert s["drafter"]["draft_vocab_size"] == 4000
    assert_released(llm)
