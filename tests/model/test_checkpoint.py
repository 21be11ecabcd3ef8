"""make-checkpoint and strict loading: byte-identical output, identical tensors, clear errors."""

import hashlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from k3trt.cli import main
from k3trt.config import ModelConfig
from k3trt.model.checkpoint_io import CheckpointReader
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.layout import vision_shapes
from k3trt.model.loader import build_model, load_model
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.model.quant import quantize_for_checkpoint
from k3trt.model.weights import WeightError, checkpoint_tensors, load_weights


def digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_and_expected_layout(tiny_ckpt, tmp_path):
    again = make_checkpoint("tiny", tmp_path / "again", seed=0)
    assert digest(again) == digest(tiny_ckpt)
    names = set(digest(tiny_ckpt))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(n.endswith(".safetensors") for n in names) >= 2          # sharded
    other = make_checkpoint("tiny", tmp_path / "other", seed=1)
    assert digest(other)["model.safetensors.index.json"] == digest(tiny_ckpt)["model.safetensors.index.json"]
    assert digest(other) != digest(tiny_ckpt)


def test_cli_make_checkpoint(tmp_path):
    res = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--output", str(tmp_path / "c"), "--seed", "0"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--output", str(tmp_path / "c")])
    assert res.exit_code != 0 and "not empty" in res.output


def test_load_gives_identical_tensors(tiny_ckpt, tiny_model):
    cfg, model = tiny_model
    written = checkpoint_tensors(model, cfg)
    vision = vision_shapes(cfg.vision)
    with CheckpointReader(tiny_ckpt) as r:
        assert sorted(r.names()) == sorted(written)
        for name, t in written.items():
            assert torch.equal(r.get(name).float(), t), name
        assert {n: r.shape(n) for n in vision} == vision        # the published vision layout
    assert any(n.startswith("language_model.model.layers.2.self_attn.q_a_proj") for n in written)


def test_make_checkpoint_writes_the_published_layout(tiny_ckpt, tiny_model):
    """Names and shapes as Moonshot publishes them (transformers' kimi_linear conversion_mapping)."""
    cfg, _ = tiny_model
    H = cfg.linear_attn_config.num_heads
    P = "language_model.model.layers."
    with CheckpointReader(tiny_ckpt) as r:
        names = set(r.names())
        for e in (0, 7):
            for w in ("w1", "w2", "w3"):
                assert f"{P}1.block_sparse_moe.experts.{e}.{w}.weight" in names
        for n in ("gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
                  "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"):
            assert f"{P}1.block_sparse_moe.{n}" in names
        assert {f"{P}0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= names       # dense layer 0
        assert r.shape(f"{P}0.self_attn.A_log") == (1, 1, H, 1)
        assert {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
                "vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight"} <= names
    private = ("w_gate", "w_up", "w_down", "fused_qkv", ".mlp.experts.", ".mlp.gate.", ".mlp.shared_experts.")
    assert not [n for n in names if any(p in n for p in private)]


def _rewrite(src, dst, edit):
    """Copy checkpoint `src` to `dst` with its tensors changed by `edit(dict)`."""
    with CheckpointReader(src) as r:
        tensors = {n: r.get(n).clone() for n in r.names()}
    edit(tensors)
    dst.mkdir()
    write_checkpoint(dst, tensors, max_shard_bytes=8 << 20)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    return dst


def _load(d):
    cfg = ModelConfig.from_json(d)
    load_weights(build_model(cfg), d, cfg)


Q_A = "language_model.model.layers.2.self_attn.q_a_proj.weight"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop(Q_A), f"missing tensor '{Q_A}'"),
    (lambda t: t.update({Q_A: t[Q_A][:, :-1]}), f"'{Q_A}' has shape"),
    (lambda t: t.update({"language_model.model.layers.0.extra.weight": torch.zeros(2)}), "layers.0.extra.weight"),
    (lambda t: t.update({Q_A: t[Q_A].to(torch.int32)}), "torch.int32"),
])
def test_strict_loading_names_the_tensor(tiny_ckpt, tmp_path, edit, match):
    bad = _rewrite(tiny_ckpt, tmp_path / "bad", edit)
    with pytest.raises((WeightError, KeyError, ValueError), match=match.replace("[", r"\[").replace(".", r"\.")):
        _load(bad)


WQKV = "vision_tower.encoder.blocks.1.wqkv.weight"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop(WQKV), f"missing tensor '{WQKV}'"),
    (lambda t: t.update({WQKV: t[WQKV][:-1]}), f"'{WQKV}' has shape"),
    (lambda t: t.update({"multi_modal_projector.linear_1.weight": torch.zeros(4, 4)}), "multi_modal_projector"),
])
def test_vision_tower_loads_strictly(tiny_ckpt, tmp_path, edit, match):
    """The vision tensors are model parameters like the others: every one read, none extra."""
    bad = _rewrite(tiny_ckpt, tmp_path / "bad", edit)
    with pytest.raises(WeightError, match=match.replace(".", r"\.")):
        _load(bad)


def test_vision_tower_is_loaded(tiny_ckpt, tiny_model):
    cfg, model = tiny_model
    assert model.vision is not None and cfg.vision.hidden_size == 32
    with CheckpointReader(tiny_ckpt) as r:
        assert torch.equal(model.vision.vision_tower.encoder.blocks[1].wqkv.weight, r.get(WQKV).float())


def test_missing_shard_and_corrupt_header(tiny_ckpt, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(tiny_ckpt, d)
    shards = sorted(d.glob("model-*.safetensors"))
    shards[-1].write_bytes(b"\xff" * 8 + b"{garbage")
    with pytest.raises(Exception, match=shards[-1].name):
        load_model(d)
    shards[-1].unlink()
    with pytest.raises(Exception, match=shards[-1].name):
        load_model(d)


@pytest.mark.parametrize("quant, suffix", [("fp8", "weight_scale_inv"), ("mxfp4", "weight_packed")])
def test_quantized_checkpoints_load_close_to_bf16(tiny_model, tmp_path, quant, suffix):
    cfg, model = tiny_model
    d = make_checkpoint("tiny", tmp_path / quant, seed=0, quant=quant)
    raw = json.loads((d / "config.json").read_text())
    assert raw["text_config"]["quantization_config"]
    with CheckpointReader(d) as r:
        assert any(n.endswith(suffix) for n in r.names())
    _, qmodel = load_model(d)
    ref = dict(model.named_parameters())
    for name, p in qmodel.named_parameters():
        err = (p - ref[name]).norm() / ref[name].norm()
        assert err < 0.2, (name, float(err))          # fp4: ~10% per weight; fp8: ~3%


P = "language_model.model.layers."


def _renamed(tensors, old, new):
    for n in [n for n in tensors if old in n]:
        tensors[n.replace(old, new)] = tensors.pop(n)


@pytest.mark.parametrize("edit", [
    # A_log in the 1-D form (the published [1, 1, H, 1] is what make-checkpoint writes)
    lambda t: t.update({f"{P}0.self_attn.A_log": t[f"{P}0.self_attn.A_log"].flatten()}),
    # a dense layer as transformers' save_pretrained spells it
    lambda t: _renamed(t, f"{P}0.mlp.", f"{P}0.block_sparse_moe."),
    # DeepSeek-V3-style copies of the embedding and lm_head inside the MTP layer (layer 4)
    lambda t: t.update({f"{P}4.embed_tokens.weight": t["language_model.model.embed_tokens.weight"].clone(),
                        f"{P}4.shared_head.head.weight": t["language_model.lm_head.weight"].clone()}),
], ids=["A_log-1d", "dense-as-block_sparse_moe", "mtp-copies"])
def test_published_variants_load_the_same(tiny_ckpt, tiny_model, tmp_path, edit):
    _, ref = tiny_model
    d = _rewrite(tiny_ckpt, tmp_path / "v", edit)
    _, model = load_model(d)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


@pytest.mark.parametrize("edit, match", [
    # a copy in a layer that is not an MTP layer is not a copy
    (lambda t: t.update({f"{P}1.embed_tokens.weight": torch.zeros(2, 2)}), r"unexpected tensor '.*layers\.1\.embed_tokens"),
    (lambda t: t.update({f"{P}4.shared_head.head.weight": torch.zeros(2, 2)}), r"MTP layer's copy"),
    (lambda t: t.update({f"{P}0.self_attn.A_log": torch.zeros(1, 2, 1, 1)}), r"A_log' has shape \(1, 2, 1, 1\)"),
])
def test_layout_variants_that_do_not_fit(tiny_ckpt, tmp_path, edit, match):
    with pytest.raises(WeightError, match=match):
        _load(_rewrite(tiny_ckpt, tmp_path / "bad", edit))


def test_unknown_layout_lists_names_with_the_nearest_rule(tiny_ckpt, tmp_path):
    """The DeepSeek-V3 MoE spelling (mlp.experts.{e}.gate_proj) is not the published Kimi layout:
    every problem is counted, the unmatched names are shown with the rule they should follow."""
    def old(t):
        _renamed(t, ".block_sparse_moe.", ".mlp.")
        _renamed(t, ".w1.", ".gate_proj.")
    d = _rewrite(tiny_ckpt, tmp_path / "old", old)
    with pytest.raises(WeightError) as e:
        _load(d)
    msg = str(e.value)
    assert "missing" in msg and "unexpected" in msg
    assert (f"unexpected tensor '{P}1.mlp.experts.0.w2.weight' (nearest known rule: "
            f"'{P}{{i}}.block_sparse_moe.experts.{{e}}.w2.weight') [and 31 more like it]") in msg
    assert f"unexpected tensor '{P}1.mlp.experts.0.gate_proj.weight'" in msg
    assert f"missing tensor '{P}1.block_sparse_moe.gate.weight'" in msg
    assert "128 missing, 128 unexpected" in msg


def test_build_validates_the_weight_index(tiny_ckpt, tmp_path):
    """`k3trt build` refuses a checkpoint the runtime would refuse, before writing anything."""
    bad = _rewrite(tiny_ckpt, tmp_path / "bad", lambda t: t.pop(Q_A))
    res = CliRunner().invoke(main, ["build", str(bad), "-o", str(tmp_path / "engine"), "--backend", "torch"])
    assert res.exit_code != 0 and f"missing tensor '{Q_A}'" in res.output
    assert not (tmp_path / "engine").exists()


def test_language_model_layers_spelling_loads(tiny_ckpt, tiny_model, tmp_path):
    """K3 checkpoints may name layers language_model.layers.* (the serving code maps them to
    language_model.model.layers.*); both load the same."""
    _, ref = tiny_model
    d = _rewrite(tiny_ckpt, tmp_path / "short", lambda t: _renamed(t, "language_model.model.layers.",
                                                                      "language_model.layers."))
    _, model = load_model(d)
    want = dict(ref.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_vision_weights_stored_fp8_load_dequantized(tiny_ckpt, tiny_model, tmp_path):
    """A checkpoint shipping the tower's projections as fp8 blocks (DeepSeek-V3 style) loads them
    dequantized, through the same quant code as the text model."""
    names = ["vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight"]

    def to_fp8(t):
        for n in names:
            t.update(quantize_for_checkpoint(n, t.pop(n).float(), "fp8"))
    d = _rewrite(tiny_ckpt, tmp_path / "fp8", to_fp8)
    cfg = ModelConfig.from_json(d)
    model = build_model(cfg)
    load_weights(model, d, cfg)
    params = dict(model.named_parameters())
    want = dict(tiny_model[1].named_parameters())
    for n in names:
        got, ref = params["vision." + n], want["vision." + n]
        assert got.shape == ref.shape and (got - ref).norm() / ref.norm() < 0.07, n
