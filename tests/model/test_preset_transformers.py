"""make-checkpoint's presets with the K3-only features off (AttnRes, latent MoE, MLA output gate,
full-rank KDA gate, KDA gate lower bound, SiTU, MTP layers) are Kimi-Linear models: k3trt's writer
gives a checkpoint transformers' kimi_linear loads strictly, with the same logits."""

import json

import pytest
import torch
from hf_utils import hf_logits
from model_utils import BLOCK, num_blocks, step_ctx

from k3trt.config import ModelConfig
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.context import ModelCache
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import checkpoint_tensors, init_random_
from k3trt.testing import rel_norm_error

transformers = pytest.importorskip("transformers", minversion="5")

K3_ONLY_OFF = {"attn_res_block_size": None, "routed_expert_hidden_size": None, "latent_moe_use_norm": False,
               "mla_use_output_gate": False, "hidden_act": "silu", "num_nextn_predict_layers": 0}


@pytest.mark.parametrize("preset", ["tiny"])     # small and medium: the same code at sizes CI cannot afford twice
def test_preset_without_k3_features_loads_in_transformers(preset, tmp_path):
    text = preset_config(preset, 1024)["text_config"]
    text.update(K3_ONLY_OFF, linear_attn_config={**text["linear_attn_config"], "use_full_rank_gate": False,
                                                 "gate_lower_bound": None})
    cfg = ModelConfig.from_dict(text)
    model = build_model(cfg, dtype=torch.float32)
    init_random_(model, 3)
    write_checkpoint(tmp_path, checkpoint_tensors(model, cfg), max_shard_bytes=1 << 20)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "model_type": "kimi_linear", "pad_token_id": 0}))
    hf, info = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = ModelCache.allocate(cfg, num_blocks=num_blocks(1), block_size=BLOCK, num_slots=1)
        got = model.logits(model(ids, step_ctx([12], [0]), cache))
    assert rel_norm_error(got, hf_logits(hf.eval(), ids)) <= 1e-4
