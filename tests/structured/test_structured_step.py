"""The structured-output step split (structured/runtime.py, StepLoop.step): drafts are cut before the
forward (GuidedState.admit, no mask), the mask rows are filled after it is launched
(GuidedState.fill_masks, or fill_masks_batch through xgrammar's BatchGrammarMatcher).

- admit cuts exactly where fill_masks does, and neither leaves the matcher advanced;
- the batched fill writes exactly the rows fill_masks writes;
- through the runtime (speculation off, n-gram, draft model; one-by-one and batched fills): greedy
  guided outputs equal masked greedy decoding by full recompute, and after every step each live
  matcher equals a fresh matcher fed the committed tokens;
- model drafts (MTP, a self-draft) are drawn under the grammar: outputs unchanged, and the
  self-draft's drafts all pass where unmasked ones were cut;
- a grammar fault in the post-launch fill ends only its request, commits nothing for it, and
  leaks nothing."""

from __future__ import annotations

import json
import random

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from runtime_utils import assert_released, one_thread  # noqa: E402

from k3trt.model.context import ModelCache, StepContext  # noqa: E402
from k3trt.model.make_checkpoint import make_checkpoint  # noqa: E402
from k3trt.runtime.llm import LLM  # noqa: E402
from k3trt.runtime.params import SamplingParams  # noqa: E402
from k3trt.runtime.speculative import DraftInput  # noqa: E402
from k3trt.runtime.speculative.draft_model import DraftModelDrafter  # noqa: E402
from k3trt.runtime.speculative.draw import Drawer  # noqa: E402
from k3trt.runtime.structured import (  # noqa: E402
    GrammarCache,
    GrammarVocab,
    GuidedSpec,
    GuidedState,
    apply_masks,
    fill_masks_batch,
    unpack,
)
from k3trt.runtime.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "maxItems": 2,
                                                    "items": {"type": "string", "maxLength": 4}}},
          "required": ["color", "n", "tags"]}
EXAMPLE = '{"color": "red", "n": 7, "tags": ["ab"]}'


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tok(engine):
    return Tokenizer.from_dir(engine / "tokenizer")


@pytest.fixture(scope="module")
def vocab(tok, tiny_model):
    return GrammarVocab(tok, vocab_size=tiny_model[0].vocab_size)


@pytest.fixture(scope="module")
def guides(vocab):
    cache = GrammarCache()
    get = lambda **kw: cache.get(GuidedSpec(**kw), vocab, timeout=60)    # noqa: E731
    yield {"json": get(json_schema=SCHEMA, max_whitespace=1),
           "think": get(json_schema=SCHEMA, max_whitespace=1, chat=True, after_reasoning=True)}
    cache.close()


def walk(guide, vocab, rng: random.Random, n: int) -> GuidedState:
    """A state advanced by n tokens its grammar admits (random ones; eos avoided)."""
    state, bm = guide.new_state(), vocab.allocate_bitmask(1)
    for _ in range(n):
        state.fill_masks([], bm, 0)
        allowed = [t for t in unpack(bm[0], vocab.vocab_size).nonzero().flatten().tolist() if t != vocab.eos_id]
        if not allowed or state.is_terminated:
            break
        state.commit([rng.choice(allowed)])
    return state


def drafts_for(state: GuidedState, vocab, rng: random.Random, k: int) -> list[int]:
    """k drafts: mostly tokens the grammar admits, some noise, specials, padding ids, eos."""
    bm, out = vocab.allocate_bitmask(k + 1), []
    for _ in range(k):
        n = state.fill_masks(out, bm, 0)           # row n: the mask after the admitted drafts
        allowed = unpack(bm[n], vocab.vocab_size).nonzero().flatten()
        r = rng.random()
        if r < 0.7 and len(allowed):
            out.append(int(allowed[rng.randrange(len(allowed))]))
        elif r < 0.8:
            out.append(rng.randrange(vocab.vocab_size))
        elif r < 0.9:
            out.append(rng.choice(sorted(vocab.special_ids)))
        else:
            out.append(rng.choice([vocab.eos_id, vocab.vocab_size - 1, vocab.vocab_size + 3, -1]))
    return out


def mask_now(state: GuidedState, vocab) -> torch.Tensor:
    bm = vocab.allocate_bitmask(1)
    state.fill_masks([], bm, 0)
    return bm[0].clone()


@pytest.mark.parametrize("kind", ["json", "think"])
def test_admit_cuts_where_fill_masks_does(kind, guides, vocab):
    rng, guide = random.Random(kind), guides[kind]
    bm = vocab.allocate_bitmask(8)
    for case in range(60):
        state = walk(guide, vocab, rng, rng.randrange(0, 30))
        drafts = drafts_for(state, vocab, rng, rng.randrange(1, 7))
        before = mask_now(state, vocab)
        n = state.admit(drafts)
        assert torch.equal(mask_now(state, vocab), before), "admit left the matcher advanced"
        assert n == state.fill_masks(drafts, bm, 0), (case, drafts)
        assert torch.equal(mask_now(state, vocab), before), "fill_masks left the matcher advanced"
        state.release()


@pytest.mark.parametrize("threads", [1, 2])
def test_fill_masks_batch_equals_fill_masks(threads, guides, vocab):
    rng = random.Random(threads)
    items, rows = [], 0
    for i in range(12):
        state = walk(guides["json" if i % 3 else "think"], vocab, rng, rng.randrange(0, 40))
        drafts = drafts_for(state, vocab, rng, rng.randrange(0, 4))
        drafts = drafts[:state.admit(drafts)]
        items.append((state, drafts, rows))
        rows += 1 + len(drafts) + rng.randrange(0, 2)      # gaps: rows of unguided requests
    before = [mask_now(s, vocab) for s, _, _ in items]
    one, many = vocab.allocate_bitmask(rows), vocab.allocate_bitmask(rows)
    for s, d, row0 in items:
        assert s.fill_masks(d, one, row0) == len(d)
    assert fill_masks_batch(items, many, xgr.BatchGrammarMatcher(threads)) == [None] * len(items)
    for s, d, row0 in items:
        assert torch.equal(one[row0:row0 + 1 + len(d)], many[row0:row0 + 1 + len(d)])
    assert all(torch.equal(mask_now(s, vocab), b) for (s, _, _), b in zip(items, before))


@pytest.mark.parametrize("kind,sample,batched", [("json", False, False), ("json", True, True),
                                                  ("think", False, True), ("think", True, False)])
def test_model_drafts_follow_the_grammar(kind, sample, batched, guides, vocab, tok, tiny_model):
    """A model drafter given a request's grammar draws every draft under it (masks filled one by
    one or through xgrammar's batched fill): all admitted, a sampled draft's q is 0 wherever the
    grammar refuses, and the matcher is back where it was."""
    cfg, model = tiny_model
    state = walk(guides[kind], vocab, random.Random(4), 6)
    before = mask_now(state, vocab)
    D = DraftModelDrafter(model, cfg, k_max=4, max_live=1, max_model_len=256, sample_drafts=True)
    D.draw.batch_min = 1 if batched else 8
    params = SamplingParams(temperature=1.0) if sample else None
    prop = D.propose([DraftInput("r", tok.encode(f"Example: {EXAMPLE}"), params=params, seed=1, guide=state)], 4)
    d = prop.tokens[0]
    assert d and state.admit(d) == len(d)
    assert torch.equal(mask_now(state, vocab), before)
    assert D.stats()["masked_drafts"] == len(d)
    if sample:
        bm = vocab.allocate_bitmask(len(d) + 1)
        assert state.fill_masks(d, bm, 0) == len(d)
        refused = ~unpack(bm[:len(d)], vocab.vocab_size)
        assert float(prop.probs[0][refused].abs().max()) == 0.0
    D.release("r")
    state.release()


# ------------------------------------------------------------------------------------------ runtime
@pytest.fixture(scope="module")
def llms(engine, tmp_path_factory):
    draft = make_checkpoint("tiny", tmp_path_factory.mktemp("draft") / "tiny-seed1", seed=1)
    arg = {"none": "none", "ngram": "ngram", "draft": f"draft:{draft}", "self": f"draft:{engine / 'rank0'}",
           "mtp": "mtp"}
    out = {name: LLM(engine, verify_checksums=False, speculative=a, spec_tokens=3) for name, a in arg.items()}
    yield out
    for llm in out.values():
        llm.close()


def masked_greedy(model, cfg, vocab, guide, prompt: list[int], n: int) -> list[int]:
    """The oracle: masked greedy decoding by full recompute (no cache, no runtime)."""
    state, bm, out = guide.new_state(), vocab.allocate_bitmask(1), []
    while not state.is_terminated and len(out) < n:
        state.fill_masks([], bm, 0)
        logits = apply_masks(_last_logits(model, cfg, prompt + out), bm)
        t = int(logits.argmax())
        assert state.commit([t]) == 1
        out.append(t)
    state.release()
    return out


def _last_logits(model, cfg, ids):
    T, bs = len(ids), 16
    nb = -(-T // bs)
    cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=bs, num_slots=1, layers=range(cfg.num_hidden_layers))
    ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None], torch.tensor([0]))
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), ctx, cache)[-1:]).float().clone()


def fresh_mask(guide, vocab, tokens: list[int]) -> torch.Tensor:
    m = xgr.GrammarMatcher(guide.grammar)
    for t in tokens:
        assert m.accept_token(t)
    bm = vocab.allocate_bitmask(1)
    if m.is_terminated():
        bm.copy_(vocab.eos_row)
    else:
        m.fill_next_token_bitmask(bm, 0)
    return bm[0]


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
@pytest.mark.parametrize("spec", ["none", "ngram", "draft"])
def test_runtime_greedy_equals_masked_greedy(spec, batched, llms, tok, vocab, guides, tiny_model):
    """The reordered step (cut, launch, fill, apply, sample) keeps greedy guided outputs exactly
    masked greedy decoding's, with and without speculation; after every step each live request's
    matcher is where a fresh matcher fed its committed tokens is."""
    cfg, model = tiny_model
    llm, guide = llms[spec], guides["json"]
    g = llm.loop.grammars
    g.batch_min = 1 if batched else 1 << 30
    try:
        prompts = [tok.encode(f"Example: {EXAMPLE}\nAnother{i}:") for i in range(3)]
        params = SamplingParams(max_tokens=40, guided=guide)
        rids = [llm.add_request(p, params) for p in prompts]
        done, checked = {}, 0
        while llm.has_unfinished():
            done.update({o.request_id: o for o in llm.step() if o.finished})
            for req in llm.loop.requests.values():
                if req.guided is not None:
                    out = req.token_ids[req.num_prompt:]
                    assert torch.equal(mask_now(req.guided, vocab), fresh_mask(guide, vocab, out)), req.request_id
                    checked += 1
        assert checked
        for p, rid in zip(prompts, rids):
            o = done[rid]
            assert o.finish_reason in ("stop", "length"), o.error
            assert o.token_ids == masked_greedy(model, cfg, vocab, guide, p, 40)
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMA)
        if spec == "ngram":
            assert llm.stats()["speculative"]["drafted_tokens"] > 0      # rows of drafts were masked
        assert_released(llm)
    finally:
        g.batch_min = 8


def test_drafts_drawn_under_the_grammar(llms, tok, vocab, guides, tiny_model, monkeypatch):
    """Model drafts of a guided request are drawn under its grammar (speculative/draw.py): outputs
    stay masked greedy decoding's (MTP and the target drafting for itself), and the self-draft has
    every draft accepted, where the same drafts drawn without the mask were cut at the first
    token the grammar refused."""
    cfg, model = tiny_model
    guide = guides["json"]
    prompts = [tok.encode(f"Example: {EXAMPLE}\nAnother{i}:") for i in range(2)]
    params = SamplingParams(max_tokens=40, guided=guide)
    want = [masked_greedy(model, cfg, vocab, guide, p, 40) for p in prompts]
    for name in ("mtp", "self"):
        llm = llms[name]
        assert [o.token_ids for o in llm.generate(prompts, params)] == want, name
        s = llm.stats()["speculative"]
        assert s["drafter"]["masked_drafts"] > 0 and s["drafted_tokens"] > 0, name
        assert_released(llm)
    s = llms["self"].stats()["speculative"]
    assert s["acceptance_rate"] == 1.0 and s["drafter"]["redirected_drafts"] > 0
    assert s["proposed_tokens"] == s["drafted_tokens"]            # the grammar cut nothing
    with monkeypatch.context() as m:      # the same drafter, drafts drawn without the grammar
        m.setattr(Drawer, "masks", lambda self, inputs: None)
        llm = llms["self"]
        before = llm.stats()["speculative"]
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        after = llm.stats()["speculative"]
    unmasked = {k: after[k] - before[k] for k in ("proposed_tokens", "drafted_tokens", "accepted_tokens")}
    assert unmasked["drafted_tokens"] < unmasked["proposed_tokens"]          # cut at refused tokens
    assert unmasked["accepted_tokens"] < s["accepted_tokens"]


class _ExplodingMatcher:
    """A matcher whose mask fill fails (one by one or batched); everything else is the real one's."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in ("fill_next_token_bitmask", "_handle"):
            raise RuntimeError("mask fill exploded")
        return getattr(self._real, name)


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_fault_in_post_launch_fill_ends_only_its_request(spec, batched, llms, tok, guides, monkeypatch):
    llm, guide = llms[spec], guides["json"]
    g = llm.loop.grammars
    monkeypatch.setattr(g, "batch_min", 1 if batched else 1 << 30)
    commits: list[tuple[int, list[int]]] = []
    commit = GuidedState.commit
    monkeypatch.setattr(GuidedState, "commit", lambda s, t: (commits.append((id(s), list(t))), commit(s, t))[1])
    prompt = tok.encode(f"Example: {EXAMPLE}\nAnother:")
    rids = [llm.add_request(prompt, SamplingParams(max_tokens=40, guided=guide)) for _ in range(4)]
    done = {}
    while not all(llm.loop.requests[r].num_output >= 3 for r in rids):     # a few tokens in
        done.update({o.request_id: o for o in llm.step() if o.finished})
    victim = llm.loop.requests[rids[2]]
    state, n_before = victim.guided, len(victim.token_ids)
    state._matcher = _ExplodingMatcher(state._matcher)
    del commits[:]
    done.update({o.request_id: o for o in llm.step() if o.finished})
    assert victim.finished and len(victim.token_ids) == n_before          # nothing committed for it
    assert state.released and id(state) not in {s for s, _ in commits}
    assert not victim.blocks and victim.kda_slot is None                   # its cache went back
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert done[rids[2]].finish_reason == "error" and "mask fill exploded" in done[rids[2]].error
    others = [done[r] for i, r in enumerate(rids) if i != 2]
    for o in others:
        assert o.finish_reason in ("stop", "length"), o.error
    assert len({tuple(o.token_ids) for o in others}) == 1                 # same prompt, same greedy output
    assert_released(llm)
