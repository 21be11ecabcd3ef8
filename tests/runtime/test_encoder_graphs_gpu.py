"""The vision encoder's CUDA graphs (runtime/encoder_graphs.py) on the GPU (marked gpu; run on the
H200): replays equal the eager encoder in bf16, at a K3-wide tower and on the tiny engine end to end."""

from __future__ import annotations

import pytest
import torch
from runtime_utils import build_tiny_engine, png

from k3trt.model.vision import VisionConfig, VisionEncoder
from k3trt.runtime.encoder_graphs import EncoderGraphs
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.testing import assert_close

pytestmark = pytest.mark.gpu

# K3's tower widths (hidden 1152, 16 heads, MLP 4304, text hidden 7168), 2 layers
K3_WIDE = VisionConfig(text_hidden_size=7168, num_hidden_layers=2)
GRID_SETS = [[(1, 32, 32)], [(1, 16, 24), (1, 40, 20), (1, 2, 2)], [(1, 64, 66)], [(1, 8, 8)] * 20]


@pytest.mark.parametrize("attention", ["auto", "masked"])
def test_replays_equal_eager_bf16(attention):
    torch.manual_seed(0)
    enc = VisionEncoder(K3_WIDE).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            p.copy_(torch.randn_like(p) * 0.02 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    graphs = EncoderGraphs(enc, (1024, 4096), device="cuda", dtype=torch.bfloat16, attention=attention)
    assert all(st.graph is not None for st in graphs.steps)
    for grids in GRID_SETS:
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(n, 3, 14, 14, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            ref = enc(pixels, torch.tensor(grids))
        out = graphs(pixels, torch.tensor(grids))
        assert not out.isnan().any()
        # the whole tower in bf16: rounding accumulates over its layers; the norm bound stays 1e-2
        assert_close(out, ref, dtype=torch.bfloat16, atol=5e-2, rtol=5e-2)
    assert graphs.stats == {"graph": 2, "eager": 2}, graphs.stats     # 64×66 > 4096 patches; 20 images > slots


def test_runtime_image_prompt_with_encoder_graphs(tiny_ckpt, tmp_path):
    engine = build_tiny_engine(tiny_ckpt, tmp_path / "engine", dtype="bf16", max_num_tokens=64,
                               encoder_capacities=[256, 1024])
    prompt = {"prompt": "<|media_pad|> and <|media_pad|>: what are these?", "images": [png(1), png(2, 84, 56)]}
    first = {}
    for graphs in (True, False):
        llm = LLM(engine, verify_checksums=False, device="cuda", cuda_graphs=graphs)
        out = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
        first[graphs] = out.token_ids[:1]            # later tokens may differ by bf16 rounding
        if graphs:
            assert [st.capacity for st in llm.session.encoder_graphs.steps] == [256, 1024]
            assert llm.session.encoder_graphs.stats["graph"] >= 1, llm.session.encoder_graphs.stats
    assert first[True] == first[False]
