"""ModelCache's stacked KDA layout: each layer's tensors are views of one tensor per kind, and
restore_kda / copy_kda over the stack equal the same operation done layer by layer."""

from __future__ import annotations

import pytest
import torch

from k3trt.config import ModelConfig
from k3trt.model.context import ModelCache
from k3trt.model.presets import preset_config
from k3trt.plugins import kda_restore

SLOTS, MAX_Q = 5, 4


def _filled(dtype: torch.dtype) -> ModelCache:
    cfg = ModelConfig.from_dict(preset_config("tiny", vocab_size=256))
    cache = ModelCache.allocate(cfg, num_blocks=2, block_size=16, num_slots=SLOTS, max_q=MAX_Q, dtype=dtype)
    st = cache.kda_stack
    for t in (st.state, st.conv, st.step_state, st.step_conv):
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    return cache


def _per_layer(cache: ModelCache) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in (c.state, c.conv, c.step_state, c.step_conv)] for c in cache.kda.values()]


def test_layer_tensors_are_views_of_the_stack():
    cache = _filled(torch.float32)
    assert len(cache.kda) == cache.kda_stack.state.shape[0] > 1
    for j, layer in enumerate(cache.kda.values()):
        layer.state[2].fill_(float(j + 7))
        assert torch.equal(cache.kda_stack.state[j, 2], layer.state[2])
        assert layer.step_state.is_contiguous() and layer.conv.is_contiguous()


@pytest.mark.parametrize("chunk", [1 << 62, 1])       # every layer at once; one layer per group
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_equals_the_layer_by_layer_rollback(monkeypatch, chunk, dtype):
    monkeypatch.setattr(kda_restore, "RESTORE_CHUNK_BYTES", chunk)
    cache = _filled(dtype)
    want = _per_layer(cache)
    slots, positions = torch.tensor([3, 0, 4]), torch.tensor([2, 0, 3])
    for state, conv, step_state, step_conv in want:
        state[slots] = step_state[slots, positions]
        conv[slots] = step_conv[slots, positions]
    cache.restore_kda(slots, positions)
    for got, exp in zip(_per_layer(cache), want):
        for g, e in zip(got, exp):
            assert torch.equal(g, e)        # a copy: exact in every dtype


def test_copy_moves_one_slot_in_every_layer_and_leaves_the_rest():
    cache = _filled(torch.bfloat16)
    want = _per_layer(cache)
    for state, conv, _, _ in want:
        state[1], conv[1] = state[4], conv[4]
    cache.copy_kda(4, 1)
    for got, exp in zip(_per_layer(cache), want):
        for g, e in zip(got, exp):
            assert torch.equal(g, e)


def test_an_unstacked_cache_is_refused_with_the_remedy():
    layer = _filled(torch.float32).kda_stack.layer(0)
    cache = ModelCache(block_size=16, kda={1: layer})          # as export.model_cache builds one
    with pytest.raises(ValueError, match="not stacked.*ModelCache.allocate"):
        cache.restore_kda(torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="not stacked"):
        cache.copy_kda(0, 1)
