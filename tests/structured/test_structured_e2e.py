"""Structured output through the runtime, end to end (structured/runtime.py + llm.py), with
speculation off and on (n-gram, draft model): every output parses and validates; reasoning first,
then JSON, with the end-of-reasoning marker inside an accepted speculative block; a grammar that
cannot finish ends "length"; bad specs are refused at add_request naming the field while other
requests carry on; a grammar fault ends only its request; `run(..., json_schema=...)` (the README's
quick start). Every test ends with all blocks, slots, drafter and grammar states released.

Sampled outputs of a random-weight model rarely end on their own, so a logits processor adds a bias
toward tokens that close strings and containers (and eos); the grammar's mask comes first, so the
bias never makes an invalid token possible."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


from runtime_utils import assert_released  # noqa: E402

import k3trt.runtime.structured.runtime as sr  # noqa: E402
from k3trt.model.make_checkpoint import make_checkpoint  # noqa: E402
from k3trt.runtime import xtml  # noqa: E402
from k3trt.runtime.chat import render_ids  # noqa: E402
from k3trt.runtime.llm import LLM, run  # noqa: E402
from k3trt.runtime.params import RequestError, SamplingParams  # noqa: E402
from k3trt.runtime.structured import GrammarCache, GrammarVocab, GuidedSpec, GuidedState  # noqa: E402
from k3trt.runtime.tokenizer import Tokenizer  # noqa: E402


def obj(required: list[str], **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required}


SCHEMAS = {
    "object": obj(["name", "age"], name={"type": "string", "maxLength": 8},
                  age={"type": "integer", "minimum": 0, "maximum": 120}, ok={"type": "boolean"}),
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
              "maxItems": 4},
    "enum": obj(["color", "size"], color={"enum": ["red", "green", "blue"]}, size={"enum": [1, 2, 3, None]}),
    "nested": obj(["user"], user=obj(["id", "tags"], id={"type": "integer", "minimum": 0, "maximum": 99},
                                     tags={"type": "array", "maxItems": 2,
                                           "items": {"type": "string", "maxLength": 4}})),
    "numbers": obj(["x", "n"], x={"type": "number", "minimum": -2.5, "maximum": 100},
                   n={"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}),
    "pattern": obj(["code"], code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
}
EXAMPLE = '{"name": "ab", "age": 7, "color": "red", "size": 1, "code": "ABC-12"}'   # n-gram drafts from it
SPECS = ["none", "ngram", "draft"]


@pytest.fixture(scope="module")
def tok(engine):
    return Tokenizer.from_dir(engine / "tokenizer")


@pytest.fixture(scope="module")
def vocab(tok, tiny_model):
    return GrammarVocab(tok, vocab_size=tiny_model[0].vocab_size)     # the model's (padded) vocabulary


@pytest.fixture(scope="module")
def compile_(vocab):
    cache = GrammarCache()
    yield lambda **kw: cache.get(GuidedSpec(**kw), vocab, timeout=60)
    cache.close()


@pytest.fixture(scope="module")
def llms(engine, tmp_path_factory):
    draft = make_checkpoint("tiny", tmp_path_factory.mktemp("draft") / "tiny-seed1", seed=1)
    arg = {"none": "none", "ngram": "ngram", "draft": f"draft:{draft}"}
    out = {name: LLM(engine, verify_checksums=False, speculative=arg[name], spec_tokens=3) for name in SPECS}
    yield out
    for llm in out.values():
        llm.close()


class Made(list):
    """GuidedStates the runtime made (each must be released), and every block committed to them."""
    blocks: list[list[int]]


@pytest.fixture
def states(monkeypatch):
    made = Made()
    made.blocks = []
    init, commit = GuidedState.__init__, GuidedState.commit

    def spy_init(self, guide):
        init(self, guide)
        made.append(self)

    def spy_commit(self, tokens):
        made.blocks.append(list(tokens))
        return commit(self, tokens)

    monkeypatch.setattr(GuidedState, "__init__", spy_init)
    monkeypatch.setattr(GuidedState, "commit", spy_commit)
    return made


def closer_bias(vocab: GrammarVocab):
    b = torch.zeros(vocab.vocab_size)
    closers = [i for i in range(vocab.vocab_size)
               if vocab.token_bytes(i).strip() and set(vocab.token_bytes(i).strip()) <= set(b'"}],')]
    b[closers] = 4.0
    b[[vocab.close_id, vocab.sep_id, vocab.eos_id]] = 8.0

    def proc(out: list[int], row: torch.Tensor) -> torch.Tensor:
        return row + b.to(row.device)
    return proc


def check_json(out, schema) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("spec", SPECS)
def test_json_schema_outputs_validate(spec, llms, tok, vocab, compile_, states):
    llm, bias = llms[spec], closer_bias(vocab)
    names = list(SCHEMAS)
    guides = {n: compile_(json_schema=SCHEMAS[n], max_whitespace=[0, 1, 2][i % 3]) for i, n in enumerate(names)}
    prompt = tok.encode("Example: " + EXAMPLE + "\nAnother:")
    params, cases = [], []
    for seed in range(2 if spec == "draft" else 4):     # the draft model costs K forwards a step
        for n in names:
            params.append(SamplingParams(max_tokens=64, temperature=1.0, seed=seed, guided=guides[n],
                                         logits_processors=(bias,)))
            cases.append(n)
    for n in names:      # greedy, no bias: must equal plain decoding's
        params.append(SamplingParams(max_tokens=48, guided=compile_(json_schema=SCHEMAS[n], max_whitespace=0)))
        cases.append(n)
    outs = llm.generate([prompt] * len(params), params)
    for n, out in zip(cases, outs):
        check_json(out, SCHEMAS[n])
    if spec != "none":
        plain = llms["none"].generate([prompt] * len(names), params[-len(names):])
        assert [o.token_ids for o in outs[-len(names):]] == [o.token_ids for o in plain]
        assert_released(llms["none"])
    if spec == "ngram":
        assert llm.stats()["speculative"]["accepted_tokens"] > 0
    assert states and all(s.released for s in states)
    assert_released(llm)


@pytest.mark.parametrize("spec", SPECS)
def test_reasoning_then_json(spec, llms, tok, vocab, states):
    """The prompt ends inside think (thinking on); the output reasons freely, closes think, and only
    then does the grammar start (chat form: the response channel, the JSON, the closing markers, eos).
    A processor forces the reasoning to repeat the earlier turn's, so the n-gram drafter proposes
    the end-of-reasoning marker from the prompt and it is accepted inside a speculative block."""
    llm, schema = llms[spec], SCHEMAS["enum"]
    reasoning = "let me see, so"
    prompt = render_ids(tok, [{"role": "user", "content": "A color?"},
                              {"role": "assistant", "reasoning_content": reasoning,
                               "content": '{"color": "red", "size": 1}'},
                              {"role": "user", "content": "Another one?"}], thinking=True)
    forced = tok.encode(reasoning) + [vocab.close_id] + tok.encode("think") + [vocab.sep_id]
    bias = closer_bias(vocab)

    def think_then_bias(out: list[int], row: torch.Tensor) -> torch.Tensor:
        if len(out) < len(forced):
            f = torch.full_like(row, float("-inf"))
            f[forced[len(out)]] = 0.0
            return f
        return bias(out, row)

    guided = {"json_schema": schema, "chat": True, "after_reasoning": True, "max_whitespace": 1}
    params = [SamplingParams(max_tokens=80, temperature=t, seed=s, guided=guided, logits_processors=(think_then_bias,))
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    outs = llm.generate([prompt] * 3, params)
    for out in outs:
        assert out.finish_reason == "stop", (out.error, out.text)
        parsed = xtml.parse(tok.decode(out.token_ids), thinking=True)
        assert parsed.reasoning == reasoning
        jsonschema.validate(json.loads(parsed.content), schema)
        assert out.token_ids[:len(forced)] == forced
    if spec == "ngram":    # the end-of-reasoning <|sep|> arrived as an accepted draft, inside a block
        assert any(vocab.sep_id in b[:-1] for b in states.blocks), states.blocks
    assert len(states) == 3 and all(s.released for s in states)
    assert_released(llm)


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_grammar_that_cannot_finish_ends_with_length(spec, llms, tok, compile_):
    llm = llms[spec]
    guide = compile_(regex="[0-9]{500}")
    out = llm.generate([tok.encode("Digits: 0123456789 0123456789")],
                       SamplingParams(max_tokens=12, guided=guide))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12 and out.text.isdigit()
    assert_released(llm)


def test_bad_specs_are_refused_up_front(llms, tok, compile_, states):
    llm = llms["ngram"]
    ok = SamplingParams(max_tokens=40, guided=compile_(json_schema=SCHEMAS["enum"], max_whitespace=0))
    prompt = tok.encode("Example: " + EXAMPLE)
    rid = llm.add_request(prompt, ok)
    llm.step()
    bad = [({"json_schema": {"type": "colour"}}, "guided.json_schema", "colour"),
           ({"regex": "(abc"}, "guided.regex", "not closed"),
           ({"grammar": "root ::= nope"}, "guided.grammar", "nope"),
           ({"json_shema": {}}, "guided.json_shema", "did you mean 'json_schema'"),
           ({"json_schema": {}, "after_reasoning": True}, "guided.after_reasoning", "after_reasoning=False"),
           ("{}", "guided", "dict")]
    for guided, field, why in bad:
        with pytest.raises(RequestError) as e:
            llm.add_request(prompt, {"max_tokens": 8, "guided": guided})
        assert e.value.field == field and why in e.value.message, (guided, str(e.value))
    chat = render_ids(tok, [{"role": "user", "content": "x"}], thinking=True)
    with pytest.raises(RequestError, match="after_reasoning=True"):
        llm.add_request(chat, SamplingParams(guided={"json_object": True}))
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    check_json(done[rid], SCHEMAS["enum"])
    assert all(s.released for s in states)
    assert_released(llm)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_grammar_fault_ends_only_its_request(spec, llms, tok, compile_, states):
    llm = llms[spec]
    guide = compile_(json_schema=SCHEMAS["enum"], max_whitespace=0)
    prompt = tok.encode("Example: " + EXAMPLE)
    params = SamplingParams(max_tokens=40, guided=guide)
    rids = [llm.add_request(prompt, params) for _ in range(4)]
    llm.step()
    while any(llm.loop.requests[r].guided is None for r in rids):   # this LLM's grammar vocabulary may
        time.sleep(0.01)                                            # still be building (off the loop)
        llm.step()                                        # then: grammars attached, prefills run

    def boom(*a, **k):
        raise RuntimeError("matcher exploded")

    llm.loop.requests[rids[1]].guided.fill_masks = boom
    llm.loop.requests[rids[2]].guided.commit = boom
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    for i in (1, 2):
        assert done[rids[i]].finish_reason == "error" and "matcher exploded" in done[rids[i]].error
    for i in (0, 3):
        check_json(done[rids[i]], SCHEMAS["enum"])
    assert done[rids[0]].token_ids == done[rids[3]].token_ids
    assert len(states) == 4 and all(s.released for s in states)
    assert_released(llm)


def test_run_quick_start(engine, tmp_path):
    """README: tiny checkpoint -> build -> generate with speculative decoding and a JSON schema."""
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS["enum"]))
    out = run(engine, "Reply in JSON:", speculative="ngram", json_schema=schema_file, max_tokens=40,
              verify_checksums=False)
    assert out["finish_reason"] == "stop" and out["error"] is None
    jsonschema.validate(json.loads(out["text"]), SCHEMAS["enum"])
    assert out["stats"]["speculative"]["method"] == "ngram" and "acceptance_rate" in out["stats"]
    json.dumps(out)                                            # what `k3trt run --json` prints
    out = run(engine, "Code:", regex="[A-Z]{3}-[0-9]{2}", max_tokens=20, verify_checksums=False)
    assert out["finish_reason"] == "stop" and len(out["text"]) == 6
    with pytest.raises(ValueError, match="at most one"):
        run(engine, "x", regex="a", grammar='root ::= "a"', verify_checksums=False)
    with pytest.raises(RequestError, match="guided.json_schema"):
        run(engine, "x", json_schema={"type": "colour"}, verify_checksums=False)


def test_compiling_holds_up_no_one(engine, tok, monkeypatch):
    """A fresh engine builds its grammar vocabulary and compiles off the step loop: an unguided
    request runs to the end meanwhile; the guided one starts when its grammar is ready. The
    vocabulary build is held on an event, so the test does not race the compile."""
    ready, real = threading.Event(), sr.GrammarVocab

    def slow_vocab(*a, **kw):
        assert ready.wait(60), "test never released the grammar build"
        return real(*a, **kw)

    monkeypatch.setattr(sr, "GrammarVocab", slow_vocab)
    llm = LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=3)
    try:
        guided = llm.add_request(tok.encode("JSON:"), {"max_tokens": 40, "guided": {
            "json_schema": SCHEMAS["enum"], "max_whitespace": 0}})
        free = llm.add_request(tok.encode("Hello"), SamplingParams(max_tokens=2, ignore_eos=True))
        req, done = llm.loop.requests[guided], {}
        while free not in done:
            done.update({o.request_id: o for o in llm.step() if o.finished})
        assert req.num_output == 0 and not req.finished          # still compiling: it held no one up
        ready.set()
        while llm.has_unfinished():
            done.update({o.request_id: o for o in llm.step() if o.finished})
        check_json(done[guided], SCHEMAS["enum"])
        assert_released(llm)
    finally:
        ready.set()
        llm.close()
