"""The layer-skip self-draft (k3trt/runtime/speculative/layer_skip.py), on the tiny engine (CPU):
its config cut to N layers, no parameter of its own, greedy speculative output equal to plain
greedy output token for token (eager drafting, and the padded static draft steps that CUDA graphs
replay), and every block, slot and drafter state released at the end."""

from __future__ import annotations

import pytest

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.speculative.layer_skip import LayerSkipDrafter, LayerSkipModel, skip_config
from runtime_utils import assert_no_leak, prompts

MAX_TOKENS = 14
LENGTHS = [20, 18, 22, 6, 12]
PARAMS = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * 4 + [SamplingParams(max_tokens=1, ignore_eos=True)]


def test_skip_config_cuts_derived_fields(tiny_model):
    cfg, _ = tiny_model           # tiny: KDA layers 1, 2, 4 and MLA layer 3 (1-based), AttnRes blocks of 2
    one, three = skip_config(cfg, 1), skip_config(cfg, 3)
    assert (one.num_hidden_layers, one.kda_layers, one.mla_layers, one.num_attn_res_blocks) == (1, (0,), (), 1)
    assert (three.kda_layers, three.mla_layers, three.num_attn_res_blocks) == ((0, 1), (2,), 2)
    assert one.num_nextn_predict_layers == three.num_nextn_predict_layers == 0
    three.validate()
    for bad in (0, cfg.num_hidden_layers):
        with pytest.raises(ValueError, match="layerskip"):
            skip_config(cfg, bad)


def test_no_parameter_of_its_own(tiny_model):
    cfg, target = tiny_model
    mine = {id(p) for p in target.parameters()}
    for n in (1, 3):
        draft = LayerSkipModel(target, n)
        assert all(id(p) in mine for p in draft.parameters())
        assert len(draft.model.layers) == n and all(a is b for a, b in zip(draft.model.layers, target.model.layers))
        assert draft.lm_head is target.lm_head and draft.model.embed_tokens is target.model.embed_tokens


@pytest.fixture(scope="module")
def plain(engine):
    ps = prompts(31, LENGTHS)
    llm = LLM(engine, verify_checksums=False)
    return ps, [o.token_ids for o in llm.generate(ps, PARAMS)]


def drive(llm: LLM, ps) -> list:
    """Requests arrive over the first steps (batches of 1..5 live requests)."""
    ids, done, step = {}, {}, 0
    while len(done) < len(ps):
        if step < len(ps):
            ids[llm.add_request(ps[step], PARAMS[step])] = step
        for out in llm.step():
            if out.finished:
                assert out.finish_reason == "length", out.error
                done[ids[out.request_id]] = out.token_ids
        step += 1
        assert step < 500, "no progress"
    return [done[i] for i in range(len(ps))]


@pytest.mark.parametrize("n,graphs", [(1, False), (3, False), (3, True)])
def test_greedy_equals_plain_decoding(engine, plain, n, graphs):
    ps, want = plain
    # 6 blocks of 16 for requests growing to 36 tokens: preemption is certain
    llm = LLM(engine, verify_checksums=False, speculative=f"layerskip:{n}", spec_tokens=3, num_blocks=6,
              max_model_len=64)
    assert isinstance(llm.spec.drafter, LayerSkipDrafter) and llm.spec.drafter.session is None   # CPU: eager
    if graphs:          # the padded static draft steps (what CUDA graphs replay), uncaptured on the CPU
        llm.spec.drafter = LayerSkipDrafter(llm.session.model, n, k_max=3, max_live=llm.config.max_batch,
                                            max_model_len=64, block_size=16, graphs=True)
    assert drive(llm, ps) == want
    spec = llm.stats()["speculative"]
    assert spec["method"] == "layerskip" and spec["drafted_tokens"] > 0 and llm.stats()["preemptions"] > 0
    if graphs:
        stats = llm.spec.drafter.session.graph_stats
        assert stats["static"] > 0                                       # draft steps
        assert sum(v for k, v in stats.items() if k.startswith("eager")) > 0   # prompt catch-ups
    assert_no_leak(llm)
    d = llm.spec.drafter      # (runtime_utils.assert_released wants an MLA layer in the draft: N=1 has none)
    assert not d.seqs and len(d.free_slots) == llm.config.max_batch and len(d.blocks.free) == d.num_blocks


def test_bad_spec_is_refused(engine):
    with pytest.raises(ValueError, match="layerskip"):
        LLM(engine, verify_checksums=False, speculative="layerskip:4", spec_tokens=3)
    with pytest.raises(ValueError, match="layerskip"):
        LLM(engine, verify_checksums=False, speculative="layerskip:x", spec_tokens=3)
