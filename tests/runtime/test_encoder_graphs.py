"""The vision encoder's static steps (runtime/encoder_graphs.py) on the CPU, uncaptured: padded to a
capacity over buffers poisoned with NaN before every call, they equal the eager encoder; calls no
capacity holds run eagerly; through the runtime, an image prompt under cuda_graphs=True uses them."""

from __future__ import annotations

import pytest
from model_utils import random_vision_encoder
import torch
from runtime_utils import png

from k3trt.model.vision import VisionConfig
from k3trt.runtime.encoder_graphs import IMAGE_SLOTS, EncoderGraphs
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.testing import assert_close

VC = VisionConfig(text_hidden_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, pos_emb_height=8, pos_emb_width=8)
CASES = {
    "fills the capacity": [(1, 8, 8)],                          # 64 patches: no padding row
    "several sizes": [(1, 4, 6), (1, 6, 8), (1, 2, 2)],         # 76 → 256
    "a two-frame clip": [(1, 6, 4), (2, 4, 4)],
    "over the largest": [(1, 16, 18)],                          # 288 > 256: eager
    "more images than slots": [(1, 2, 2)] * (IMAGE_SLOTS + 1),  # eager
}


@pytest.fixture(scope="module")
def encoder():
    return random_vision_encoder(VC)


def _poison(graphs: EncoderGraphs) -> None:
    """Every buffer a step reads: floats NaN, integers out of range (a call must overwrite all)."""
    for st in graphs.steps:
        st.pixels.fill_(float("nan"))
        st.cu.fill_(10**6)
        for t in st.meta.values():
            t.fill_(float("nan") if t.is_floating_point() else 10**6)


@pytest.mark.parametrize("case", list(CASES))
def test_static_steps_equal_eager(encoder, case):
    graphs = EncoderGraphs(encoder, (64, 256), device="cpu", dtype=torch.float32, capture=False)
    assert graphs.attention == "masked"
    grids = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, VC.patch_size, VC.patch_size, generator=g)
    with torch.no_grad():
        ref = encoder(pixels, torch.tensor(grids))
    for _ in range(2):              # the second call finds the first call's data in the buffers
        _poison(graphs)
        out = graphs(pixels, torch.tensor(grids))
        assert_close(out, ref, dtype=torch.float32, atol=1e-5, rtol=1e-5, rel_norm=1e-5)
    eager = case in ("over the largest", "more images than slots")
    assert graphs.stats == ({"eager": 2} if eager else {"static": 2})


def test_bad_capacities_and_patch_counts(encoder):
    with pytest.raises(ValueError, match="multiples of 4"):
        EncoderGraphs(encoder, (62,), device="cpu", dtype=torch.float32, capture=False)
    graphs = EncoderGraphs(encoder, (64,), device="cpu", dtype=torch.float32, capture=False)
    with pytest.raises(ValueError, match="need 24"):
        graphs(torch.zeros(20, 3, VC.patch_size, VC.patch_size), torch.tensor([(1, 4, 6)]))


def test_runtime_image_prompt_through_static_encoder_steps(engine):
    """cuda_graphs=True on the CPU: static padded steps, the encoder's among them; the output equals
    the eager engine's token for token."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = {"prompt": "<|media_pad|> and <|media_pad|>: what are these?", "images": [png(1), png(2, 84, 56)]}
    outs = {}
    for graphs in (False, True):
        llm = LLM(engine, verify_checksums=False, cuda_graphs=graphs)
        outs[graphs] = llm.generate(prompt, params)[0].token_ids
        if graphs:
            assert llm.session.encoder_graphs.stats["static"] >= 1, llm.session.encoder_graphs.stats
    assert outs[True] == outs[False]
