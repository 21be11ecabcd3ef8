"""Speculative decoding's self-contained half: acceptance (greedy cases; stochastic draws from the
target distribution by chi-square, for first and later positions, arbitrary and one-hot drafts),
stop-token truncation, the n-gram drafter, and the model drafters (draft model, MTP): proposals
against full-recompute oracles and state rollback after a rejection."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from k3trt.model.context import ModelCache, StepContext
from k3trt.runtime import sampling
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.speculative import (AcceptanceStats, DraftInput, NgramConfig, NgramDrafter, accept_greedy,
                                       accept_stochastic, make_drafter, pad_drafts, pad_q)
from k3trt.runtime.speculative.draft_model import DraftModelDrafter
from k3trt.runtime.speculative.mtp import MTPDrafter
from k3trt.testing import assert_close
from runtime_utils import BLOCK, prompts, reference_greedy


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model's ops are far too small for intra-op threads; on a shared 2-core runner they
    only contend (a 60x slowdown measured), so this module runs single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# ------------------------------------------------------------------------------------ greedy
GREEDY_CASES = {   # name: (drafts, target tokens per row, accepted n, emitted)
    "all accepted + bonus": ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8]),
    "first rejected": ([5, 6, 7], [9, 6, 7, 8], 0, [9]),
    "middle rejected": ([5, 6, 7], [5, 1, 7, 8], 1, [5, 1]),
    "zero drafts": ([], [4], 0, [4]),
}


@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_cases(name):
    drafts, target, n, emitted = GREEDY_CASES[name]
    d, nd = pad_drafts([drafts])
    acc = accept_greedy(torch.tensor([target]), d, nd)
    assert acc.num_accepted == [n] and acc.tokens == [emitted] and acc.num_drafts == [len(drafts)]


def test_greedy_ragged_batch_equals_one_by_one():
    cases = list(GREEDY_CASES.values())
    d, nd = pad_drafts([c[0] for c in cases])
    K = d.shape[1]
    # padded target rows hold a token equal to the padding: must not count as an acceptance
    target = torch.tensor([c[1] + [0] * (K + 1 - len(c[1])) for c in cases])
    acc = accept_greedy(target, d, nd)
    assert acc.num_accepted == [c[2] for c in cases] and acc.tokens == [c[3] for c in cases]
    stats = AcceptanceStats()
    stats.add(acc)
    s = stats.to_dict()
    assert (s["verify_steps"], s["drafted_tokens"], s["accepted_tokens"]) == (3, 9, 4)
    assert s["accepted_length_histogram"] == {0: 1, 1: 1, 3: 1} and s["mean_accepted_length"] == pytest.approx(7 / 3)


# ------------------------------------------------------------------------------------ stochastic
V, TRIALS = 8, 20000


def markov(seed: int, zero_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A first-token distribution [V] and a transition matrix [V, V]; zero_last rules out token V-1
    (as top-k / top-p filtering does) so a draft of it must always be rejected."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V + 1, V, generator=g) * 0.6
    if zero_last:
        x[:, -1] = float("-inf")
    p = torch.softmax(x, -1)
    return p[0], p[1:]


def speculative_generate(k: int, n_tokens: int, one_hot: bool, seed: int) -> torch.Tensor:
    """TRIALS independent generations of n_tokens by repeated speculative steps (as the runtime runs
    them): target p is a Markov chain, drafts come from a different chain q (or its argmax)."""
    P1, T = markov(1, zero_last=True)
    Q1, Q = markov(2, zero_last=False)
    gen = torch.Generator().manual_seed(seed)
    seqs: list[list[int]] = [[] for _ in range(TRIALS)]
    while active := [b for b in range(TRIALS) if len(seqs[b]) < n_tokens]:
        last = torch.tensor([seqs[b][-1] if seqs[b] else -1 for b in active])
        first = (last < 0)[:, None]
        qrow = torch.where(first, Q1, Q[last.clamp(min=0)])
        ps, qs, ds = [torch.where(first, P1, T[last.clamp(min=0)])], [], []
        for _ in range(k):
            d = qrow.argmax(-1) if one_hot else torch.multinomial(qrow, 1, generator=gen)[:, 0]
            ds.append(d), qs.append(qrow), ps.append(T[d])
            qrow = Q[d]
        acc = accept_stochastic(torch.stack(ps, 1), torch.stack(ds, 1), torch.full((len(active),), k),
                                None if one_hot else torch.stack(qs, 1), gen)
        for b, toks in zip(active, acc.tokens):
            seqs[b].extend(toks)
    return torch.tensor([s[:n_tokens] for s in seqs])


def check_counts(observed: torch.Tensor, want: torch.Tensor, what: str) -> None:
    observed, want = observed.flatten().double(), want.flatten().double()
    want = want / want.sum() * TRIALS            # fp32 probabilities: renormalise in fp64 for scipy
    support = want > 0
    assert observed[~support].sum() == 0, f"{what}: drew a token the target rules out"
    stat = chisquare(observed[support].numpy(), want[support].numpy())
    assert stat.pvalue > 1e-3, f"{what}: chi-square p={stat.pvalue:.2g}"


@pytest.mark.parametrize("k,one_hot", [(3, False), (2, True), (1, False)])
def test_stochastic_matches_plain_sampling(k, one_hot):
    """k + 1 tokens per trial, so the first step's bonus position is inside the window: the first
    token and every consecutive pair follow the target chain."""
    toks = speculative_generate(k, k + 1, one_hot, seed=10 + k)
    P1, T = markov(1, zero_last=True)
    check_counts(torch.bincount(toks[:, 0], minlength=V), P1, "first token")
    marginal = P1
    for t in range(k):
        pair = torch.bincount(toks[:, t] * V + toks[:, t + 1], minlength=V * V)
        check_counts(pair, marginal[:, None] * T, f"tokens {t + 1}-{t + 2}")
        marginal = marginal @ T


def test_stochastic_rules_and_reproducibility():
    P1, T = markov(1, zero_last=True)
    p = torch.stack([P1, T[0], T[1]])[None]               # [1, 3, V]
    # a draft the target rules out (p = 0) is never accepted, whatever q says
    for s in range(50):
        g = torch.Generator().manual_seed(s)
        acc = accept_stochastic(p, torch.tensor([[V - 1, 0]]), torch.tensor([2]), None, [g])
        assert acc.num_accepted == [0] and acc.tokens[0][0] != V - 1
    # no drafts: exactly plain sampling's draw from the same generator state
    for s in range(20):
        a = accept_stochastic(p[:, :1], torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), None,
                              [torch.Generator().manual_seed(s)])
        assert a.tokens == [[int(sampling.draw(P1[None], torch.Generator().manual_seed(s))[0])]]
    # per-request generators: a request's outcome does not depend on its batch mates
    ps = torch.stack([P1, T[3], T[5]])[None].expand(4, -1, -1).contiguous()
    d, nd = pad_drafts([[3, 5], [3], [], [2, 2]])
    batch = accept_stochastic(ps, d, nd, None, [torch.Generator().manual_seed(i) for i in range(4)])
    for i in range(4):
        one = accept_stochastic(ps[i:i + 1], d[i:i + 1, :int(nd[i])], nd[i:i + 1], None,
                                [torch.Generator().manual_seed(i)])
        assert one.tokens[0] == batch.tokens[i] and one.num_accepted[0] == batch.num_accepted[i]
    # mixed batches: a request without q (one-hot) gets one-hot rows from pad_q, same outcome
    q1 = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(7)), -1)
    q = pad_q([q1, None, None, None], d, V)
    assert pad_q([None] * 4, d, V) is None and torch.equal(q[0], q1)
    mixed = accept_stochastic(ps, d, nd, q, [torch.Generator().manual_seed(i) for i in range(4)])
    assert mixed.tokens[1:] == batch.tokens[1:]


# ------------------------------------------------------------------------------------ n-gram
def brute_ngram(h: list[int], k: int, cfg: NgramConfig) -> list[int]:
    """The n-gram proposal by a full scan (the oracle for the incremental index)."""
    L = len(h)
    for n in range(min(cfg.max_n, L), cfg.min_n - 1, -1):
        for e in range(L - 1, n - 1, -1):                     # most recent earlier occurrence first
            if h[e - n:e] == h[L - n:]:
                out: list[int] = []
                for j in range(k):
                    out.append(h[e + j] if e + j < L else out[e + j - L])
                return out
    return []


def test_ngram_cases():
    dr = NgramDrafter(NgramConfig(max_n=3, min_n=1))
    prop = lambda rid, h, k=3, cap=None: dr.propose([DraftInput(rid, h, max_drafts=cap)], k).tokens[0]  # noqa: E731
    assert prop("rep", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert prop("periodic", [7, 7, 7], k=4) == [7, 7, 7, 7]      # continues past the history's end
    assert prop("none", [1, 2, 3, 4, 5]) == []
    assert prop("short", [9]) == []
    assert prop("empty", []) == []
    # the longest suffix wins over a more recent shorter match; among equals the most recent wins
    assert prop("longest", [1, 2, 3, 8, 9, 2, 3, 5, 1, 2, 3]) == [8, 9, 2]
    assert prop("recent", [4, 1, 4, 2, 4, 3, 5, 4]) == [3, 5, 4]
    assert prop("cap", [1, 2, 3, 1, 2], cap=1) == [3]
    assert NgramDrafter(NgramConfig(max_n=3, min_n=2)).propose([DraftInput("x", [5, 1, 5])], 3).tokens == [[]]


def test_ngram_incremental_equals_full_scan():
    rng = random.Random(0)
    cfg = NgramConfig(max_n=4, min_n=1)
    dr = NgramDrafter(cfg)
    hs = {r: [] for r in "abc"}
    for _ in range(300):
        for r, h in hs.items():        # histories grow by 1..4 tokens per step, like committed blocks
            h.extend(rng.randrange(4 if r != "c" else 50) for _ in range(rng.randint(1, 4)))
        got = dr.propose([DraftInput(r, h) for r, h in hs.items()], 5).tokens
        assert got == [brute_ngram(h, 5, cfg) for h in hs.values()]
    dr.release("a")
    assert "a" not in dr._index


# ------------------------------------------------------------------------------------ model drafters
def target_hidden(model, cfg, ids: list[int]) -> torch.Tensor:
    """The target's hidden states for every position of `ids` by one fresh forward."""
    T = len(ids)
    nb = -(-T // BLOCK)
    cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=BLOCK, num_slots=1, layers=range(cfg.num_hidden_layers))
    ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None], torch.tensor([0]))
    with torch.inference_mode():
        return model(torch.tensor(ids), ctx, cache)


def mtp_oracle(model, cfg, prev: torch.Tensor, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K3ForCausalLM.mtp over a whole sequence in a fresh cache: (hidden, logits) of every row."""
    T = len(next_ids)
    nb = -(-T // BLOCK)
    L = cfg.num_hidden_layers
    cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=BLOCK, num_slots=1, layers=range(L, L + 1))
    ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None], torch.tensor([0]))
    with torch.inference_mode():
        return model.mtp(0, prev, torch.tensor(next_ids), ctx, cache)


def draft_drafter(tiny_model, **kw) -> DraftModelDrafter:
    cfg, model = tiny_model
    return DraftModelDrafter(model, cfg, **{**dict(k_max=4, max_live=3, max_model_len=128), **kw})


def greedy_next(model, cfg, prefix: list[int], drafts: list[int]) -> list[int]:
    """The target's greedy token after prefix + drafts[:j] for every j, by one forward (a verify
    step's oracle): drafts are the greedy continuation iff this equals them."""
    hidden = target_hidden(model, cfg, prefix + drafts)
    return model.logits(hidden[len(prefix) - 1:]).argmax(-1).tolist()[:len(drafts)]


def test_draft_model_self_draft_is_greedy(tiny_model):
    """Draft = target: the proposals are the target's greedy continuation, for every request of a
    batch whose members are at different stages (first propose, caught up after a commit)."""
    cfg, model = tiny_model
    a, b = prompts(1, [21, 9])
    dr = draft_drafter(tiny_model)
    d = dr.propose([DraftInput("a", a)], 3).tokens[0]
    assert len(d) == 3 and d == greedy_next(model, cfg, a, d)
    x = reference_greedy(model, cfg, b, 1)
    dr.on_commit("a", d)                          # all three accepted; the bonus token equals d_3 here
    got = dr.propose([DraftInput("a", a + d), DraftInput("b", b + x, max_drafts=2)], 3)
    assert [len(t) for t in got.tokens] == [3, 2] and got.probs == [None, None]
    assert got.tokens[0] == greedy_next(model, cfg, a + d, got.tokens[0])
    assert got.tokens[1] == greedy_next(model, cfg, b + x, got.tokens[1])
    dr.release("a"), dr.release("b")
    assert len(dr.free_slots) == 3 and len(dr.blocks.free) == dr.cache.mla[cfg.mla_layers[0]].shape[0]


def test_draft_model_rollback(tiny_model):
    """After a rejection the drafter's state equals (bitwise) that of a drafter whose drafts were
    all accepted up to there, and its next proposals equal those of a fresh drafter."""
    (a,) = prompts(2, [19])
    A, B, C = draft_drafter(tiny_model), draft_drafter(tiny_model), draft_drafter(tiny_model)
    d = A.propose([DraftInput("r", a)], 4).tokens[0]
    assert B.propose([DraftInput("r", a)], 3).tokens[0] == d[:3]     # B runs d_1, d_2 only; A also d_3
    wrong = (d[2] + 1) % 1000                    # the target rejects d_3: commits d_1, d_2, then its own token
    hist = a + d[:2] + [wrong]
    A.on_commit("r", d[:2] + [wrong])
    B.on_commit("r", d[:2] + [wrong])
    assert A.seqs["r"].cached == B.seqs["r"].cached == len(a) + 2
    for i, layer in A.cache.kda.items():
        s = A.seqs["r"].slot
        assert torch.equal(layer.state[s], B.cache.kda[i].state[s]) and torch.equal(layer.conv[s], B.cache.kda[i].conv[s])
    nxt = A.propose([DraftInput("r", hist)], 4).tokens[0]
    assert nxt == B.propose([DraftInput("r", hist)], 4).tokens[0]
    assert nxt == C.propose([DraftInput("r", hist)], 4).tokens[0]
    # the lazy path: a second rejection without on_commit reconciles against the history in propose
    hist2 = hist + nxt[:1] + [(nxt[1] + 1) % 1000]
    assert A.propose([DraftInput("r", hist2)], 3).tokens[0] == draft_drafter(tiny_model).propose(
        [DraftInput("r", hist2)], 3).tokens[0]


def test_draft_model_sampled_drafts(tiny_model):
    """sample_drafts: q is the processed draft distribution, the drafts lie in its support, and the
    same seed gives the same drafts."""
    cfg, model = tiny_model
    (a,) = prompts(3, [12])
    params = SamplingParams(temperature=0.8, top_k=20, seed=5)
    runs = [draft_drafter(tiny_model, sample_drafts=True).propose([DraftInput("s", a, params=params, seed=5)], 3)
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    q = runs[0].probs[0]
    assert q.shape == (3, cfg.vocab_size)
    assert_close(q.sum(-1), torch.ones(3))
    assert all(q[j, t] > 0 for j, t in enumerate(runs[0].tokens[0]))
    assert int((q[0] > 0).sum()) <= 20
    # row j is sampling.probs of the target's own logits after a + d[:j] (draft = target)
    hidden = target_hidden(model, cfg, a + runs[0].tokens[0][:2])
    assert_close(q, sampling.probs(model.logits(hidden[len(a) - 1:]), params), atol=1e-5, rtol=1e-3)


def test_mtp_matches_oracle_and_rolls_back(tiny_model):
    cfg, model = tiny_model
    (a,) = prompts(4, [17])
    P = len(a)
    x = int(model.logits(target_hidden(model, cfg, a)[-1:]).argmax())
    hid = target_hidden(model, cfg, a + [x])
    A = make_drafter("mtp", k=3, max_live=2, max_model_len=128, target=model, sample_drafts=True)
    assert isinstance(A, MTPDrafter)
    A.on_hidden("r", 0, hid[:P])                  # prefill: every prompt position; x_P was sampled after it
    prop = A.propose([DraftInput("r", a + [x], params=SamplingParams(temperature=1.0))], 3)
    d = prop.tokens[0]
    # oracle: K3ForCausalLM.mtp over the whole sequence, on the target's final-normed hiddens, chained
    # on its own (shared_head-normed) output past the positions whose target hidden is known
    with torch.inference_mode():
        prev, ids = model.model.norm(hid[:P]), (a + [x])[1:]
    for j in range(3):
        g, logits = mtp_oracle(model, cfg, prev, ids)
        assert_close(prop.probs[0][j], torch.softmax(logits[-1], -1), atol=1e-6, rtol=1e-3, name=f"q_{j}")
        prev, ids = torch.cat([prev, g[-1:]]), ids + [d[j]]
    A.draw.sample_drafts = False
    d = A.propose([DraftInput("r", a + [x])], 3).tokens[0]   # argmax drafts, the next part rejects d_2
    # verify accepted d_1 and rejected d_2: rows 0..1 (positions P, P+1) are handed over
    hist = a + [x, d[0], (d[1] + 1) % 1000]
    hid2 = target_hidden(model, cfg, hist)
    A.on_commit("r", hist[P + 1:])
    A.on_hidden("r", P, hid2[P:P + 2])
    C = MTPDrafter(model, cfg, k_max=3, max_live=2, max_model_len=128)
    C.on_hidden("r", 0, torch.cat([hid[:P], hid2[P:P + 2]]))
    got = A.propose([DraftInput("r", hist)], 3).tokens[0]
    assert got == C.propose([DraftInput("r", hist)], 3).tokens[0]
    # no hand-over for the newest positions: no drafts (never stale ones); a gap is an error
    assert A.propose([DraftInput("r", hist + [1, 2])], 3).tokens == [[]]
    with pytest.raises(ValueError, match="hidden states"):
        A.on_hidden("r", P + 9, hid2[:1])
    A.release("r")
    assert not A.seqs


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_random_rejections_match_a_fresh_drafter(tiny_model, kind):
    """Many steps of propose -> (random acceptance length, a target token) -> commit: every proposal
    equals that of a fresh drafter given only the committed history (and, for MTP, the hiddens).
    Drafts are sampled at temperature 1 so that q (the drafter's softmax) is compared too, not only
    argmaxes; both drafters draw from a generator seeded alike for every step."""
    cfg, model = tiny_model
    rng = random.Random(3)
    params = SamplingParams(temperature=1.0)

    def make():
        kw = dict(k_max=4, max_live=3, max_model_len=128, sample_drafts=True)
        return DraftModelDrafter(model, cfg, **kw) if kind == "draft" else MTPDrafter(model, cfg, **kw)

    (hist,) = prompts(5, [14])
    known = target_hidden(model, cfg, hist)          # the prefill's rows
    hist = hist + [int(model.logits(known[-1:]).argmax())]
    A = make()
    if kind == "mtp":
        A.on_hidden("r", 0, known)
    for step in range(8):
        k = rng.randint(1, 4)
        inp = DraftInput("r", hist, params=params, seed=step)
        if "r" in A.seqs:
            A.seqs["r"].generator = sampling.make_generator(step, "cpu")
        got = A.propose([inp], k)
        fresh = make()
        if kind == "mtp":
            fresh.on_hidden("r", 0, known)
        want = fresh.propose([inp], k)
        d = got.tokens[0]
        assert len(d) == k and d == want.tokens[0]
        assert_close(got.probs[0], want.probs[0], atol=1e-5, rtol=1e-3, name=f"q at step {step}")
        n = rng.randint(0, k)
        commit = d[:n] + [rng.randrange(1000)]        # n accepted, then the target's (here random) token
        if kind == "mtp":                             # verify rows 0..n: positions len(hist)-1 ..
            rows = target_hidden(model, cfg, hist + d[:n])[len(hist) - 1:]
            A.on_hidden("r", len(hist) - 1, rows)
            known = torch.cat([known, rows])
        A.on_commit("r", commit)
        hist = hist + commit


def test_make_drafter_errors(tmp_path):
    with pytest.raises(ValueError, match="1..7"):
        make_drafter("ngram", k=8, max_live=1, max_model_len=16)
    with pytest.raises(ValueError, match="not a checkpoint"):
        make_drafter(f"draft:{tmp_path}", k=3, max_live=1, max_model_len=16)
    with pytest.raises(ValueError, match="unknown"):
        make_drafter("eagle", k=3, max_live=1, max_model_len=16)
    assert make_drafter("none", k=3, max_live=1, max_model_len=16).propose([DraftInput("x", [1, 2])], 3).tokens == [[]]
