"""The build report's arithmetic (k3trt/model/footprint.py) on the released Kimi-Linear-48B-A3B
config and on K3's published sizes, and `k3trt build` printing it and refusing, before any long
work, a model that cannot fit the target device."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from k3trt.cli import main
from k3trt.config import ModelConfig
from k3trt.model.checkpoint_io import CheckpointReader
from k3trt.model.footprint import GIB, DoesNotFitError, footprint
from k3trt.model.presets import preset_config
from k3trt.parallel.config import ParallelConfig, ParallelConfigError

KIMI_LINEAR_48B = Path(__file__).parents[1] / "data" / "kimi_linear_48b_a3b_config.json"
# K3's published text-config sizes (spec/K3_MODEL.md) on the medium preset's per-layer dims:
# 93 layers (24 MLA, every fourth), 896 routed experts.
K3_SIZES = {"num_hidden_layers": 93, "num_experts": 896, "attn_res_block_size": 12}


@pytest.fixture(scope="module")
def kimi_linear():
    return ModelConfig.from_json(KIMI_LINEAR_48B)


def k3_config() -> ModelConfig:
    raw = preset_config("medium", 163840)
    mla = [i for i in range(1, 94) if i % 4 == 0]
    raw["text_config"].update(K3_SIZES, linear_attn_config={
        **raw["text_config"]["linear_attn_config"], "full_attn_layers": mla,
        "kda_layers": [i for i in range(1, 94) if i not in mla]})
    return ModelConfig.from_dict(raw)


def test_kimi_linear_48b_parameters_equal_transformers(kimi_linear):
    """Independent count: transformers' KimiLinearForCausalLM on the released config.json, whose
    router correction biases are buffers (k3trt loads them as parameters)."""
    transformers = pytest.importorskip("transformers", minversion="5")
    with torch.device("meta"):
        hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**json.loads(KIMI_LINEAR_48B.read_text())))
    want = sum(p.numel() for p in hf.parameters())
    want += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    fp = footprint(kimi_linear)
    assert fp.params == fp.params_per_rank == want
    assert 48e9 < fp.params < 50e9                    # "48B-A3B" (embeddings and lm_head not counted there)
    assert fp.weight_bytes_per_rank == 2 * want      # bf16


def test_kimi_linear_48b_cache_plan(kimi_linear):
    fp = footprint(kimi_linear, kv_dtype=torch.float8_e4m3fn)
    # 7 MLA layers x (kv_lora 512 + rope 64) x 1 byte
    assert fp.mla_bytes_per_token == 7 * 576
    # 20 KDA layers x (fp32 state 32 heads x 128 x 128 + bf16 q/k/v conv windows 3 x 32 x 128 x 3)
    assert fp.kda_bytes_per_seq == 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2)
    lines = "\n".join(fp.lines())
    assert "49.123 B" in lines and "4,032 bytes per token" in lines and "41.41 MiB per sequence" in lines


def test_per_rank_shards(kimi_linear):
    whole = footprint(kimi_linear)
    routed = 26 * 256 * 3 * 2304 * 1024              # 26 MoE layers of 256 experts
    ep8 = footprint(kimi_linear, pc=ParallelConfig(ep=8))
    assert ep8.params == whole.params
    assert ep8.params_per_rank == whole.params - routed + routed // 8
    tp4 = footprint(kimi_linear, pc=ParallelConfig(tp=4, dcp=4))
    # TP splits attention, dense and shared MLPs and lm_head, never the routed experts (EP does)
    lm_head = 163840 * 2304
    assert routed < tp4.params_per_rank < whole.params_per_rank - lm_head * 3 // 4
    assert tp4.kda_bytes_per_seq == whole.kda_bytes_per_seq // 4     # KDA heads split
    assert tp4.mla_bytes_per_token == whole.mla_bytes_per_token // 4  # tokens split by DCP; the latent is not split by TP
    assert "each of 4 ranks (tp=4, dcp=4, ep=1)" in "\n".join(tp4.lines())
    with pytest.raises(ParallelConfigError, match="num_experts"):
        footprint(kimi_linear, pc=ParallelConfig(ep=3))


def test_fit_check_names_the_numbers_and_the_remedy(kimi_linear):
    fp = footprint(kimi_linear)                       # 91.5 GiB of bf16 weights
    with pytest.raises(DoesNotFitError) as e:
        fp.check_fits(80 * GIB)
    msg = str(e.value)
    assert "91.5 GiB" in msg and "80.0 GiB" in msg and "--tp" in msg and "--ep" in msg and "mxfp4" in msg
    footprint(kimi_linear, pc=ParallelConfig(ep=2)).check_fits(80 * GIB)
    footprint(kimi_linear).check_fits(141 * GIB)


def test_k3_sizes():
    cfg = k3_config()
    assert (len(cfg.mla_layers), len(cfg.kda_layers)) == (23, 70)
    fp = footprint(cfg, pc=ParallelConfig(tp=8, dcp=8, ep=8))
    routed = 92 * 896 * 3 * 3584 * 3072              # every layer but the first is MoE
    assert fp.params > routed and fp.params_per_rank > routed // 8
    assert fp.mla_bytes_per_token == 23 * 576 * 2 // 8
    assert fp.kda_bytes_per_seq == 70 * (12 * 128 * 128 * 4 + 3 * 12 * 128 * 3 * 2)
    with pytest.raises(DoesNotFitError, match="does not fit"):
        fp.check_fits(141 * GIB)                     # bf16 K3 on eight H200s


def test_tiny_preset_count_equals_its_checkpoint(tiny_ckpt):
    """Independent count: every tensor make-checkpoint wrote (language model and vision tower)."""
    cfg = ModelConfig.from_json(tiny_ckpt)
    with CheckpointReader(tiny_ckpt) as r:
        n = sum(r.get(name).numel() for name in r.names())
    assert footprint(cfg).params == n


def test_build_prints_the_report_and_stops_before_work_when_it_cannot_fit(tiny_ckpt, tmp_path):
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["build", str(tiny_ckpt), "-o", str(out), "--backend", "torch",
                                    "--device-memory", "0.0001"])
    assert res.exit_code != 0 and "does not fit the target device" in res.output, res.output
    assert not out.exists()
    res = CliRunner().invoke(main, ["build", str(tiny_ckpt), "-o", str(out), "--backend", "torch",
                                    "--device-memory", "80", "--tp", "2"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("parameters: ") and "weights on each of 2 ranks" in lines[1]
    assert lines[2].startswith("cache plan: MLA latent cache") and lines[-1] == str(out)
