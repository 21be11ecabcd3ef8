"""The request API: validation that names the field, faults confined to one request, stop strings
and stop ids, finish reasons, streaming and cancellation; no leak however a request ends."""

from __future__ import annotations

import pytest

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import MAX_STOP_STRINGS, RequestError, SamplingParams
from k3trt.runtime.request import FinishReason, Request
from runtime_utils import assert_no_leak, prompts

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine, verify_checksums=False, max_model_len=64)


@pytest.fixture(scope="module")
def baseline(llm):
    ps = prompts(31, [7, 12, 5])
    return ps, [o.token_ids for o in llm.generate(ps, GREEDY)]


@pytest.mark.parametrize("prompt,params,field", [
    ([], None, "prompt"),
    ("", None, "prompt"),
    (list(range(1, 65)), None, "prompt"),                       # max_model_len is 64
    ([1, 2, -3], None, "prompt"),
    ([1, 2], dict(max_tokens=0), "max_tokens"),
    ([1, 2], dict(max_tokens=-4), "max_tokens"),
    ([1, 2], dict(temprature=0.5), "temprature"),               # unknown parameter
    ([1, 2], dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    ([1, 2], dict(top_p=0.0), "top_p"),
    ([1, 2], dict(temperature=-1.0), "temperature"),
    ([1, 2], dict(seed="seven"), "seed"),
])
def test_bad_requests_are_rejected_without_disturbing_others(llm, baseline, prompt, params, field):
    ps, want = baseline
    ids = [llm.add_request(p, GREEDY) for p in ps]
    llm.step()
    llm.step()
    with pytest.raises(RequestError) as e:
        llm.add_request(prompt, params)
    assert e.value.field == field and field in str(e.value)
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert [done[i].token_ids for i in ids] == want
    assert_no_leak(llm)


def test_batch_validation_names_the_request(llm):
    with pytest.raises(RequestError, match=r"max_tokens.*\(request 1\)"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(), {"max_tokens": 0}])
    assert_no_leak(llm)


def test_fault_in_one_request_ends_only_that_request(llm, baseline):
    ps, want = baseline
    calls = []

    def broken(ids, logits):
        calls.append(len(ids))
        if len(ids) == 2:
            raise RuntimeError("processor exploded")
        return logits

    bad = SamplingParams(max_tokens=8, ignore_eos=True, logits_processors=(broken,))
    outs = llm.generate([ps[0], ps[1], ps[2]], [GREEDY, bad, GREEDY])
    assert outs[1].finish_reason == "error" and "processor exploded" in outs[1].error
    assert len(outs[1].token_ids) == 2
    assert [outs[0].token_ids, outs[2].token_ids] == [want[0], want[2]]
    assert_no_leak(llm)


def test_stop_token_ids_and_max_tokens(llm, baseline):
    ps, want = baseline
    stop_at = want[0][3]
    out = llm.generate([ps[0]], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == want[0][:want[0].index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    out = llm.generate([ps[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == want[0][:3] and out.finish_reason == "length"
    assert_no_leak(llm)


def test_stop_strings_cut_the_text(llm, baseline):
    ps, want = baseline
    full = llm.generate([ps[1]], GREEDY)[0]
    assert full.text == llm.tokenizer.decode(want[1], skip_special=True)
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 3]
    at = full.text.find(stop)
    out = llm.generate([ps[1]], SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:at]
    assert want[1][:len(out.token_ids)] == out.token_ids
    kept = llm.generate([ps[1]], SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:at + len(stop)]
    assert_no_leak(llm)


def test_stream_deltas_add_up(llm, baseline):
    ps, want = baseline
    text, ids, finals = {}, {}, {}
    for d in llm.stream(ps[:2], SamplingParams(max_tokens=8, ignore_eos=True, stop=["\x00never"])):
        text[d.index] = text.get(d.index, "") + d.delta_text
        ids[d.index] = ids.get(d.index, []) + d.delta_token_ids
        if d.finished:
            finals[d.index] = d
    for i in range(2):
        assert ids[i] == finals[i].token_ids == want[i]
        assert text[i] == finals[i].text
    assert_no_leak(llm)


def test_closing_a_stream_cancels_its_requests(llm, baseline):
    ps, _ = baseline
    it = llm.stream(ps, GREEDY)
    first = next(it)
    assert not first.finished
    it.close()
    assert_no_leak(llm)


def test_abort(llm, baseline):
    ps, want = baseline
    a = llm.add_request(ps[0], GREEDY)
    b = llm.add_request(ps[1], GREEDY)
    llm.step()
    llm.abort(a)
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    done.update({o.request_id: o for o in llm.step() if o.finished})
    assert done[a].finish_reason == "abort"
    assert done[b].token_ids == want[1]
    assert_no_leak(llm)


def test_block_end_cuts_at_stop_tokens_and_room():
    """Request.block_end: an emitted block ends after its first stop token (kept) and within the
    request's room (max_tokens, max_model_len)."""
    def end(tokens, eos=frozenset(), max_model_len=100, output=0, **params):
        req = Request("r", 0, [1, 1, 1], SamplingParams(**params))
        req.token_ids += [1] * output
        return req.block_end(tokens, frozenset(eos), max_model_len)

    stop, length = FinishReason.STOP, FinishReason.LENGTH
    assert end([5, 2, 7, 2], eos={2}) == (2, (stop, 2))
    assert end([5, 6, 7], eos={2}, stop_token_ids=(9,)) == (3, None)
    assert end([5, 9, 7], stop_token_ids=(9,)) == (2, (stop, 9))
    assert end([2], eos={2}) == (1, (stop, 2))
    assert end([5, 2, 7], eos={2}, ignore_eos=True) == (3, None)
    assert end([5, 6, 2], eos={2}, max_tokens=4, output=2) == (2, (length, None))
    assert end([5, 6, 7], max_model_len=5) == (2, (length, None))       # prompt 3 + 2 = max_model_len
    assert end([5, 2], eos={2}, max_tokens=2) == (2, (stop, 2))         # a stop token wins over length
