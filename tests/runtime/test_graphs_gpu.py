"""CUDA graphs of the decode / verify steps on the GPU (marked gpu; run on the H200).

A captured session and an uncaptured one (the same padded static steps run eagerly) start from the
same caches and see the same batches: every replay's logits, hidden states and the caches it
writes must equal the uncaptured run's. Then the runtime end to end: greedy generation with graphs
on completes, uses the graphs, and its first tokens equal the eager session's.
"""

from __future__ import annotations

import pytest
import torch
from runtime_utils import BLOCK, assert_released, build_tiny_engine, prompts

from k3trt.model.loader import load_model
from k3trt.runtime.engine import Seq, make_batch
from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.kv_cache import plan_cache
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.testing import assert_close

pytestmark = pytest.mark.gpu


def _sessions(tiny_ckpt):
    out = []
    for capture in (True, False):
        cfg, model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cuda")
        plan = plan_cache(cfg, budget_bytes=1 << 28, block_size=BLOCK, max_live=4, max_model_len=256,
                          kv_dtype=torch.bfloat16, state_dtype=torch.bfloat16, max_q=4)
        out.append(GraphSession(model, cfg, plan, device="cuda", dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                max_q=4, capacities=(1, 2, 4), q_values=(1, 4), max_blocks=256 // BLOCK,
                                capture=capture))
    return out


def test_replays_equal_uncaptured_steps(tiny_ckpt):
    graph, plain = _sessions(tiny_ckpt)
    assert all(st.graph is not None for st in graph.steps.values())
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 40]
    blocks = [[3 * i, 3 * i + 1, 3 * i + 2, 3 * i + 12] for i in range(3)]
    ctx = [0, 0, 0]
    for s in (graph, plain):                   # prefill runs eagerly in both
        seqs = [Seq(torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist(), 0,
                    blocks[i], i, 1) for i, n in enumerate(lens)]
        s.prefill(make_batch(seqs, BLOCK, capacity=64))
    ctx = list(lens)
    for step, (live, q) in enumerate([(3, 1), (3, 4), (2, 1), (1, 4), (3, 4)]):
        seqs = [Seq(torch.randint(1, 1000, (q,), generator=g).tolist(), ctx[i], blocks[i], i, q)
                for i in range(live)]
        cap = 1 if live == 1 else 2 if live == 2 else 4
        outs = []
        for s in (graph, plain):
            logits = s.verify(make_batch(seqs, BLOCK, capacity=cap, save_kda_states=q > 1, keep_hidden=True))
            outs.append((logits.clone(), s.hidden.clone()))
        assert not outs[0][0].isnan().any()
        assert_close(outs[0][0], outs[1][0], dtype=torch.bfloat16)
        assert_close(outs[0][1], outs[1][1], dtype=torch.bfloat16)
        for i in range(live):
            ctx[i] += q
        for layer, cache in graph.cache.mla.items():
            assert_close(cache, plain.cache.mla[layer], dtype=torch.bfloat16)
        for layer, kda in graph.cache.kda.items():
            n = graph.spare_slot                      # the spare slot is scratch: not compared
            assert_close(kda.state[:n], plain.cache.kda[layer].state[:n], dtype=torch.float32)
    assert graph.graph_stats["graph"] == 5 and plain.graph_stats["static"] == 5


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_runtime_with_graphs(tiny_ckpt, tmp_path, spec):
    engine = build_tiny_engine(tiny_ckpt, tmp_path / "engine", dtype="bf16", max_num_tokens=64)
    ps = prompts(3, [6, 11, 30, 4])
    kw = dict(verify_checksums=False, device="cuda", **({} if spec == "none" else dict(speculative=spec, spec_tokens=3)))
    first = {}
    for graphs in (True, False):
        llm = LLM(engine, cuda_graphs=graphs, **kw)
        outs = llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
        assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)
        first[graphs] = [o.token_ids[:1] for o in outs]     # later tokens may differ by bf16 rounding
        if graphs:
            assert llm.session.graph_stats["graph"] > 0, llm.session.graph_stats
        assert_released(llm)
    assert first[True] == first[False]
