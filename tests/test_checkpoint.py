"""make-checkpoint and strict loading: byte-identical output, identical tensors, clear errors."""

import hashlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from k3trt.cli import main
from k3trt.config import ModelConfig
from k3trt.model.checkpoint_io import CheckpointReader, write_checkpoint
from k3trt.model.loader import build_model, load_model
from k3trt.model.make_checkpoint import make_checkpoint
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
    with CheckpointReader(tiny_ckpt) as r:
        assert sorted(r.names()) == sorted(written)
        for name, t in written.items():
            assert torch.equal(r.get(name).float(), t), name
    assert any(n.startswith("language_model.model.layers.2.self_attn.q_a_proj") for n in written)
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight" in written


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


def test_vision_tower_is_skipped_and_logged(tiny_ckpt, tmp_path, caplog):
    d = _rewrite(tiny_ckpt, tmp_path / "vl", lambda t: t.update({
        "vision_tower.encoder.blocks.0.wqkv.weight": torch.zeros(4, 4),
        "multi_modal_projector.linear_1.weight": torch.zeros(4, 4)}))
    _load(d)
    assert "skipped 2 tensors of the vision tower" in caplog.text


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
