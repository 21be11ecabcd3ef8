"""Structured output (k3trt/runtime/structured): grammars over the real K3 tokenizer, driven the way
the runtime drives them (fill_masks -> cut drafts -> masked logits -> accept -> commit), with random
logits, random drafts and random acceptance, and with the tiny model's real logits.

Random logits get a bias toward tokens that close things (quotes, brackets, XTML markers, eos) so
that random outputs end within a few hundred tokens; every output must parse and validate."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from k3trt.model.context import ModelCache, StepContext  # noqa: E402
from k3trt.runtime import xtml  # noqa: E402
from k3trt.runtime.structured import (  # noqa: E402
    GrammarCache,
    GrammarError,
    GrammarVocab,
    GuidedSpec,
    apply_masks,
    compile_guide,
    pack,
    unpack,
)
from k3trt.runtime.tokenizer import Tokenizer  # noqa: E402


def validate(instance, schema) -> None:
    # imported here: the GPU machine runs this file's CUDA test without jsonschema installed
    pytest.importorskip("jsonschema").validate(instance, schema)


PAD = 128  # the test vocab is padded past the tokenizer's, like a model whose lm_head is padded


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny CPU ops: torch's thread pool costs more than it gains (and the CI box is shared)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vocab(tok):
    return GrammarVocab(tok, vocab_size=tok.vocab_size + PAD)


@pytest.fixture(scope="module")
def cache():
    c = GrammarCache(threads=2)
    yield c
    c.close()


@pytest.fixture(scope="module")
def bias(vocab):
    b = torch.zeros(vocab.vocab_size)
    # tokens made only of closing punctuation (and whitespace): they end strings and containers
    closers = [i for i in range(vocab.vocab_size)
               if vocab.token_bytes(i).strip() and set(vocab.token_bytes(i).strip()) <= set(b'"}],')]
    b[closers] = 5.0
    b[[vocab.open_id, vocab.close_id, vocab.sep_id, vocab.eos_id]] = 9.0
    return b


class Run:
    """One seeded generation through the runtime's call sequence. Drafts come from a reference
    matcher that tracks the committed tokens (a drafter that knows the grammar), each corrupted with
    some probability; the accepted length is random (any prefix of the admitted drafts)."""

    def __init__(self, guide, bias, seed: int, *, k: int = 0, corrupt: float = 0.3):
        self.guide, self.vocab, self.bias, self.k, self.corrupt = guide, guide.vocab, bias, k, corrupt
        self.g, self.rng = torch.Generator().manual_seed(seed), random.Random(seed)
        self.state = guide.new_state()
        self.ref = xgr.GrammarMatcher(guide.grammar)  # fed only what reaches the grammar
        self.bm = self.vocab.allocate_bitmask(k + 1)
        self.out: list[int] = []

    def logits(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.vocab.vocab_size, generator=self.g) * 2 + self.bias

    def propose(self) -> list[int]:
        drafts, bm = [], self.vocab.allocate_bitmask(1)
        for _ in range(self.rng.randint(0, self.k)):  # fewer than K (or none) is fine
            if self.ref.is_terminated():
                break
            self.ref.fill_next_token_bitmask(bm, 0)
            t = int(apply_masks(self.logits(1), bm).argmax())
            assert self.ref.accept_token(t)
            drafts.append(t)
        if drafts:
            self.ref.rollback(len(drafts))
        return [self.rng.randrange(self.vocab.vocab_size) if self.rng.random() < self.corrupt else t
                for t in drafts]

    def step(self) -> list[int]:
        drafts = self.propose() if self.k else []
        n = self.state.fill_masks(drafts, self.bm, 0)
        assert 0 <= n <= len(drafts)
        drafts = drafts[:n]
        logits = apply_masks(self.logits(n + 1), self.bm[: n + 1])
        a = self.rng.randint(0, n)
        block = drafts[:a] + [int(logits[a].argmax())]
        used = self.state.commit(block)
        assert used == len(block) or self.state.is_terminated
        for t in block[:used]:
            assert self.ref.accept_token(t), "the reference matcher refused a committed token"
        self.out += block[:used]
        return block[:used]

    def run(self, max_tokens: int = 400) -> list[int]:
        while not self.state.is_terminated and len(self.out) < max_tokens:
            self.step()
        return self.out


def masks_equal_fresh(guide, tokens: list[int], state) -> bool:
    """The state's next-token mask equals a fresh matcher's after `tokens`."""
    fresh = xgr.GrammarMatcher(guide.grammar)
    for t in tokens:
        assert fresh.accept_token(t)
    a, b = guide.vocab.allocate_bitmask(1), guide.vocab.allocate_bitmask(1)
    if fresh.is_terminated():
        b.copy_(guide.vocab.eos_row)
    else:
        fresh.fill_next_token_bitmask(b, 0)
    state.fill_masks([], a, 0)
    return torch.equal(a, b)


def obj(required: list[str], **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required}


INT = {"type": "integer"}
SCHEMAS = {
    "object": obj(["name", "age"], name={"type": "string", "maxLength": 8},
                  age={"type": "integer", "minimum": 0, "maximum": 120}, ok={"type": "boolean"}),
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
              "minItems": 1, "maxItems": 4},
    "enum": obj(["color", "size"], color={"enum": ["red", "green", "blue"]},
                size={"enum": [1, 2, 3, None]}),
    "nested": obj(["user", "items"],
                  user=obj(["id", "tags"], id=INT, tags={"type": "array", "maxItems": 3, "items": {
                      "type": "string", "maxLength": 5}}),
                  items={"type": "array", "maxItems": 2, "items": obj(["sku"], sku={
                      "type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"})}),
    "numbers": obj(["x", "n", "m"], x={"type": "number", "minimum": -2.5, "maximum": 100},
                   n={"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
                   m={"type": "integer", "multipleOf": 5}),
    "pattern": obj(["code", "phone"], code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
                   phone={"type": "string", "pattern": "^\\+?[0-9]{3}( [0-9]{3}){2}$"}),
}


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(name, k, tok, vocab, cache, bias):
    schema = SCHEMAS[name]
    for seed in range(6):
        ws = [None, 0, 2][seed % 3]
        guide = cache.get(GuidedSpec(json_schema=schema, max_whitespace=ws), vocab)
        run = Run(guide, bias, seed, k=k)
        out = run.run()
        assert run.state.is_terminated, f"{name} seed {seed}: no end in {len(out)} tokens"
        assert out[-1] == vocab.eos_id
        text = tok.decode(out[:-1])
        validate(json.loads(text), schema)
        assert masks_equal_fresh(guide, out, run.state)
        run.state.release()


def test_json_object_and_regex_and_ebnf(tok, vocab, cache, bias):
    cases = [
        (GuidedSpec(json_object=True, max_whitespace=1), lambda s: isinstance(json.loads(s), dict)),
        (GuidedSpec(regex=r"[A-Z][a-z]{1,6}, [0-9]{1,3} (apples|pears)"),
         lambda s: re.fullmatch(r"[A-Z][a-z]{1,6}, [0-9]{1,3} (apples|pears)", s) is not None),
        (GuidedSpec(grammar='root ::= "[" num ("," num)* "]"\nnum ::= "-"? [1-9] [0-9]?'),
         lambda s: all(isinstance(v, int) and 0 < abs(v) < 100 for v in json.loads(s))),
    ]
    for spec, check in cases:
        guide = cache.get(spec, vocab)
        for seed in range(4):
            run = Run(guide, bias, seed, k=2)
            out = run.run()
            assert run.state.is_terminated and out[-1] == vocab.eos_id
            assert check(tok.decode(out[:-1])), (spec.kind, tok.decode(out))
    # chat form, thinking off: the prompt opened the response; the grammar closes the turn
    regex = r"(yes|no), [0-9]{1,2}%"
    guide = cache.get(GuidedSpec(regex=regex, chat=True), vocab)
    for seed in range(3):
        run = Run(guide, bias, seed, k=2)
        text = tok.decode(run.run())
        assert text.endswith("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
        assert re.fullmatch(regex, xtml.parse(text, thinking=False).content), text


def test_random_drafts_keep_matcher_in_sync(vocab, cache, bias):
    """After every commit the state's matcher equals the reference fed the committed tokens, and a
    mask fill leaves the matcher where it was."""
    guide = cache.get(GuidedSpec(json_schema=SCHEMAS["nested"], max_whitespace=2), vocab)
    for seed in range(3):
        run = Run(guide, bias, 100 + seed, k=5, corrupt=0.5)
        before, after = vocab.allocate_bitmask(1), vocab.allocate_bitmask(1)
        while not run.state.is_terminated and len(run.out) < 400:
            run.state.fill_masks([], before, 0)
            run.step()
            ref = vocab.allocate_bitmask(1)
            if run.ref.is_terminated():
                ref.copy_(vocab.eos_row)
            else:
                run.ref.fill_next_token_bitmask(ref, 0)
            run.state.fill_masks([], after, 0)
            assert torch.equal(after, ref)
        assert run.state.is_terminated


def test_mask_rows_follow_the_drafts(vocab, cache, tok):
    """Row i of a fill is the mask after the committed tokens + drafts[:i]; the first invalid draft
    cuts the rest (a rejected suffix), and the matcher is never left advanced."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    guide = cache.get(GuidedSpec(json_schema=schema, max_whitespace=1), vocab)   # '{"a":12}' allowed
    state = guide.new_state()
    prefix = tok.encode('{"a":')
    assert state.commit(prefix) == len(prefix)
    good = tok.encode("12")
    drafts = good + tok.encode("x") + tok.encode("}")   # "x" is not JSON here: cut at it
    bm = vocab.allocate_bitmask(len(drafts) + 1)
    n = state.fill_masks(drafts, bm, 0)
    assert n == len(good)
    for i in range(n + 1):
        fresh = xgr.GrammarMatcher(guide.grammar)
        for t in prefix + drafts[:i]:
            assert fresh.accept_token(t)
        row = vocab.allocate_bitmask(1)
        fresh.fill_next_token_bitmask(row, 0)
        assert torch.equal(bm[i], row[0])
    assert masks_equal_fresh(guide, prefix, state)          # rolled back
    assert state.fill_masks([vocab.vocab_size + 5, -1], bm, 0) == 0   # a drafter's garbage id
    assert state.commit(good[:1]) == 1                       # accept a prefix of the drafts
    assert masks_equal_fresh(guide, prefix + good[:1], state)
    # row0 lands where asked; other rows are untouched
    bm2 = vocab.allocate_bitmask(4)
    bm2[0].fill_(7)
    assert state.fill_masks([], bm2, 2) == 0
    assert int(bm2[0, 0]) == 7 and torch.equal(bm2[3], torch.full_like(bm2[3], -1))
    state.release()


def test_terminal_state_with_trailing_drafts(vocab, cache, tok):
    guide = cache.get(GuidedSpec(json_schema={"type": "array", "items": {"type": "integer"}},
                                 max_whitespace=1), vocab)                      # '[1,2]' allowed
    state = guide.new_state()
    body = tok.encode("[1,2]")
    assert state.commit(body) == len(body) and not state.is_terminated
    eos, junk = vocab.eos_id, tok.encode(",3]")
    bm = vocab.allocate_bitmask(5)
    assert state.fill_masks([], bm, 0) == 0
    allowed = unpack(bm[0], vocab.vocab_size)
    assert allowed.nonzero().flatten().tolist() == [eos]        # complete: only eos
    assert state.fill_masks([eos] + junk, bm, 0) == 1           # eos passes, what follows does not
    assert torch.equal(bm[1], vocab.eos_row)
    assert state.commit([eos] + junk) == 1 and state.is_terminated   # the caller drops the rest
    assert state.commit(junk) == 0
    assert state.fill_masks(junk, bm, 0) == 0 and torch.equal(bm[0], vocab.eos_row)
    # an accepted block that runs through the end: only up to eos is consumed
    state.reset()
    block = tok.encode("[7]") + [eos] + junk
    assert state.commit(block) == len(tok.encode("[7]")) + 1 and state.is_terminated
    state.release()
    with pytest.raises(RuntimeError):
        state.commit([eos])


def test_committing_a_masked_token_fails_the_request(vocab, cache, tok):
    guide = cache.get(GuidedSpec(regex="[0-9]+"), vocab)
    state = guide.new_state()
    with pytest.raises(GrammarError, match="breaks the grammar"):
        state.commit(tok.encode("12a"))


def reasoning_ids(tok, vocab, text: str, name: str = "think") -> list[int]:
    return tok.encode(text) + [vocab.close_id] + tok.encode(name) + [vocab.sep_id]


@pytest.mark.parametrize("chat", [False, True])
def test_reasoning_then_json(chat, tok, vocab, cache, bias):
    schema = SCHEMAS["enum"]
    guide = cache.get(GuidedSpec(json_schema=schema, after_reasoning=True, chat=chat, max_whitespace=2),
                      vocab)
    for seed in range(4):
        state = guide.new_state()
        # a marker that is not the end of reasoning, and whitespace inside the real one
        fake = tok.encode("hmm") + [vocab.close_id] + tok.encode("thinking") + [vocab.sep_id]
        real = tok.encode("so") + [vocab.close_id] + tok.encode(" think ") + [vocab.sep_id]
        bm = vocab.allocate_bitmask(40)
        # eos cannot end the reasoning; the grammar starts right after <|sep|>, mid-block
        assert state.fill_masks(fake + [vocab.eos_id], bm, 0) == len(fake)
        first = [vocab.open_id] if chat else tok.encode("{")
        drafts = fake + real + first
        assert state.fill_masks(drafts, bm, 0) == len(drafts)
        end = len(fake) + len(real)                # row `end`: the first after the marker
        assert torch.equal(bm[0], vocab.free_row) and torch.equal(bm[end - 1], vocab.free_row)
        assert not torch.equal(bm[end], vocab.free_row)   # a grammar row
        assert state.fill_masks(fake + real + tok.encode("Z"), bm, 0) == len(fake) + len(real)
        cut = len(fake) + len(real) - 2           # commit a block that ends inside the marker...
        assert state.commit(drafts[:cut]) == cut and state.in_reasoning
        assert state.commit(drafts[cut:]) == len(drafts) - cut and not state.in_reasoning  # ...then the rest
        run = Run(guide, bias, seed, k=3)
        run.state.release()
        run.state = state
        for t in first:
            assert run.ref.accept_token(t)
        out = drafts + run.run()
        assert state.is_terminated and out[-1] == vocab.eos_id
        parsed = xtml.parse(tok.decode(out), thinking=True)
        assert parsed.reasoning is not None and parsed.reasoning.startswith("hmm")
        validate(json.loads(parsed.content), schema)
        if chat:
            text = tok.decode(out[len(fake) + len(real):])
            assert text.startswith("<|open|>response<|sep|>")
            assert text.endswith("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")


def tool(name: str, parameters: dict | None = None) -> dict:
    fn = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": fn}


TOOLS = [
    # checked argument by argument
    tool("get_weather", obj(["city", "days"], city={"type": "string", "maxLength": 12},
                            days={"type": "integer", "minimum": 1, "maximum": 7},
                            units={"enum": ["c", "f"]},
                            when={"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"})),
    tool("search", obj(["query"], query={"type": "string"},
                       filters=obj(["lang"], lang={"enum": ["en", "zh"]}),
                       limit={"type": ["integer", "null"]})),
    # a union needs the json element; no parameters means any arguments (also the json element)
    tool("set_value", obj(["v"], v={"anyOf": [{"type": "string", "maxLength": 4}, {"type": "number"}]})),
    tool("ping"),
]


@pytest.mark.parametrize("choice", ["required", "get_weather", "set_value", "ping"])
def test_tool_call_structural_tag(choice, tok, vocab, cache, bias):
    params = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    for seed in range(4):
        after = seed % 2 == 1
        spec = GuidedSpec.for_tools(TOOLS, choice, after_reasoning=after, max_whitespace=2,
                                    parallel_tool_calls=seed < 2)
        guide = cache.get(spec, vocab)
        run = Run(guide, bias, seed, k=3)
        prefix = reasoning_ids(tok, vocab, "plan") if after else []
        assert run.state.commit(prefix) == len(prefix)
        if spec.bounds_reasoning:    # a forced call's grammar covers its (bounded) reasoning too
            assert all(run.ref.accept_token(t) for t in prefix)
        out = prefix + run.run(600)
        assert run.state.is_terminated and out[-1] == vocab.eos_id, tok.decode(out)
        parsed = xtml.parse(tok.decode(out), thinking=after)
        assert parsed.tool_calls, tok.decode(out)
        assert seed < 2 or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            assert call.name == choice or choice == "required"
            validate(call.arguments, params[call.name])


def test_padding_and_apply_masks(tok, vocab, cache):
    V = vocab.vocab_size
    real = tok.vocab_size
    for row in (vocab.free_row, vocab.eos_row):
        assert not unpack(row, V)[real:].any()
    guide = cache.get(GuidedSpec(regex="[\\s\\S]*"), vocab)        # everything the grammar can allow
    bm = vocab.allocate_bitmask(3)
    guide.new_state().fill_masks([], bm, 1)
    allowed = unpack(bm[1], V)
    assert not allowed[real:].any() and not allowed[vocab.open_id] and allowed[vocab.eos_id]
    assert not allowed[list(vocab.special_ids - {vocab.eos_id})].any()
    assert torch.equal(pack(allowed), bm[1])
    # torch path (float64 logits: xgrammar's CPU kernel takes fp32/bf16/fp16 only, so apply_masks
    # unpacks with torch) == xgrammar's CPU kernel; logits wider than the mask; only some rows
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (3, vocab.num_words), generator=g, dtype=torch.int32)
    logits = torch.randn(3, V, generator=g)
    ours, theirs = apply_masks(logits.double(), bits).float(), logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bits, backend="cpu")
    assert torch.equal(ours, theirs)
    wide = apply_masks(torch.randn(3, V + 40, generator=g), bits, indices=[0, 2])
    assert torch.isinf(wide[[0, 2], V:]).all() and not torch.isinf(wide[1]).any()
    assert torch.equal(torch.isinf(wide[[0, 2], :V]), ~unpack(bits[[0, 2]], V))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_masks_cuda_matches_cpu(dtype):
    """xgrammar's kernel on CUDA masks exactly what the torch path masks on the CPU (padding past
    the mask and a subset of rows included)."""
    g = torch.Generator().manual_seed(1)
    V, rows = 129408 + 128, 6
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (rows, -(-V // 32)), generator=g, dtype=torch.int32)
    logits = torch.randn(rows, V + 64, generator=g).to(dtype)
    for indices in (None, [0, 3, 5]):
        cpu = apply_masks(logits.clone(), bits, indices)
        gpu = apply_masks(logits.cuda(), bits.pin_memory(), indices)
        assert torch.equal(gpu.cpu(), cpu)


def test_invalid_specs_name_the_field_and_reason():
    bad = [
        (dict(json_schema='{"type": "object"'), "json_schema", "not valid JSON"),
        (dict(json_schema={"type": "colour"}), "json_schema", 'Unsupported type "colour"'),
        (dict(json_schema={"type": "string", "pattern": "(ab"}), "json_schema", "parenthesis"),
        (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "json_schema", "minimum greater"),
        (dict(json_schema=[1, 2]), "json_schema", "object or a boolean"),
        (dict(regex="a{3,1}"), "regex", "Lower bound is larger"),
        (dict(regex="(abc"), "regex", "not closed"),
        (dict(grammar='root ::= "a" | '), "grammar", "Expect element"),
        (dict(grammar='root ::= undefined_rule'), "grammar", 'Rule "undefined_rule" is not defined'),
        (dict(grammar='start ::= "a"'), "grammar", 'root rule with name "root"'),
        (dict(), "guided", "exactly one"),
        (dict(regex="a", json_object=True), "guided", "exactly one"),
        (dict(tools=TOOLS, tool_choice="nope"), "tool_choice", "nope"),
        (dict(tools=TOOLS), "tools", "tool_choice"),
        (dict(tools=TOOLS[:1] * 2, tool_choice="required"), "tools", "unique"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
              tool_choice="f"), "tools[0].parameters", "invalid JSON schema"),
        (dict(regex="a", max_whitespace=-1), "max_whitespace", ">= 0"),
    ]
    for kw, field, why in bad:
        with pytest.raises(GrammarError) as e:
            GuidedSpec(**kw)
        assert e.value.field == field and why in str(e.value), (kw, str(e.value))
        assert "/project/cpp" not in str(e.value)
    assert GuidedSpec.from_response_format({"type": "text"}) is None
    assert GuidedSpec.for_tools(TOOLS, "auto") is None
    spec = GuidedSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    same = GuidedSpec(json_schema={"type": "object"})  # dict or text: one cache key
    assert spec == same == GuidedSpec(json_schema='{"type":"object"}') and hash(spec) == hash(same)
    assert GuidedSpec.for_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}).chat


def test_grammar_cache(vocab):
    cache = GrammarCache(max_entries=2, threads=1)
    try:
        specs = [GuidedSpec(regex=f"[a-z]{{{n}}}") for n in (1, 2, 3)]
        f0 = cache.submit(specs[0], vocab)
        assert cache.submit(GuidedSpec(regex="[a-z]{1}"), vocab) is f0 and cache.hits == 1
        for s in specs[1:]:
            cache.submit(s, vocab)
        assert len(cache) == 2 and cache.submit(specs[0], vocab) is not f0   # evicted, recompiled
        guide = f0.result(timeout=30)
        assert guide.spec == specs[0] and guide.vocab is vocab
    finally:
        cache.close()


def test_unfinished_grammar_never_blocks(tok, vocab, cache, bias):
    """A grammar that cannot end within max_tokens just keeps masking (digits are at most 3 per
    token, so 500 of them need > 30 tokens); the runtime's max_tokens check ends it ("length")."""
    guide = cache.get(GuidedSpec(regex="[0-9]{500}"), vocab)
    run = Run(guide, bias, 0, k=3)
    out = run.run(max_tokens=30)
    assert not run.state.is_terminated and 30 <= len(out) < 34
    assert re.fullmatch("[0-9]+", tok.decode(out))


# ---- the tiny model's real logits --------------------------------------------------------------
def _all_logits(model, cfg, ids: list[int]) -> torch.Tensor:
    """Logits at every position by full recompute (a fresh cache each call)."""
    block, T = 16, len(ids)
    nb = -(-T // block)
    cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=block, num_slots=1,
                                layers=range(cfg.num_hidden_layers))
    ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None],
                      torch.tensor([0]))
    with torch.inference_mode():
        logits = model.logits(model(torch.tensor(ids), ctx, cache)).float()
    return logits.clone()  # a normal tensor: masks are applied in place


def test_tiny_model_greedy_json_with_and_without_speculation(tiny_ckpt, tiny_model):
    """Masked greedy decoding with the random-weight model gives valid JSON, and greedy
    speculative decoding (random drafts, masks per row, cut, verify K+1 rows, commit) gives the same
    tokens as plain masked greedy decoding."""
    cfg, model = tiny_model
    tok = Tokenizer.from_dir(tiny_ckpt)
    vocab = GrammarVocab(tok, vocab_size=cfg.vocab_size)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "n"]}
    guide = compile_guide(GuidedSpec(json_schema=schema, max_whitespace=0), vocab)
    prompt = tok.encode("Reply in JSON:")

    def plain() -> list[int]:
        state, bm, out = guide.new_state(), vocab.allocate_bitmask(1), []
        while not state.is_terminated and len(out) < 40:
            state.fill_masks([], bm, 0)
            t = int(apply_masks(_all_logits(model, cfg, prompt + out)[-1:], bm).argmax())
            assert state.commit([t]) == 1
            out.append(t)
        return out

    def speculative(seed: int, k: int = 3) -> list[int]:
        rng, state, bm, out = random.Random(seed), guide.new_state(), vocab.allocate_bitmask(k + 1), []
        while not state.is_terminated and len(out) < 40:
            # a drafter that is right half the time: the reference continuation, else noise
            drafts = [ref[len(out) + i] if rng.random() < 0.6 and len(out) + i < len(ref)
                      else rng.randrange(tok.vocab_size) for i in range(k)]
            n = state.fill_masks(drafts, bm, 0)
            drafts = drafts[:n]
            logits = apply_masks(_all_logits(model, cfg, prompt + out + drafts)[-(n + 1):], bm[: n + 1])
            target = logits.argmax(-1).tolist()
            a = 0
            while a < n and drafts[a] == target[a]:
                a += 1
            block = drafts[:a] + [target[a]]
            out += block[: state.commit(block)]
        return out

    ref = plain()
    assert ref[-1] == vocab.eos_id
    validate(json.loads(tok.decode(ref[:-1])), schema)
    for seed in range(2):
        assert speculative(seed) == ref
