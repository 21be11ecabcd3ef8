"""`k3trt build` refuses bad input before any long work: a checkpoint that is not K3, invalid
capacities, targets the backend cannot build, an uninstalled backend, too little disk."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest
from click.testing import CliRunner

import k3trt.builder.backends as backends
import k3trt.builder.rank as rank
import k3trt.engine.backends as registry
from k3trt.cli import main as cli
from test_build import RTX_ARGS, needs_rtx, _leftovers  # noqa: E402  (this directory is on sys.path)



def _cli(args, **kw):
    return CliRunner().invoke(cli, ["build", *args], **kw)


@pytest.fixture
def no_long_work(monkeypatch):
    monkeypatch.setattr(rank, "build_rank", lambda *a, **k: pytest.fail("the long work started"))
    monkeypatch.setattr(rank.ModelSource, "load", lambda self: pytest.fail("the model was loaded"))


@pytest.mark.parametrize("backend", ["torch", "tensorrt-rtx"])
def test_cli_refuses_a_checkpoint_that_is_not_k3(backend, tmp_path, no_long_work):
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    r = _cli([str(ckpt), "-o", str(tmp_path / "e"), "--backend", backend, "--target", "sm120"])
    assert r.exit_code == 1 and "is not a Kimi K3 checkpoint" in r.output and "'llama'" in r.output, r.output
    r = _cli([str(tmp_path), "-o", str(tmp_path / "e"), "--backend", backend, "--target", "sm120"])
    assert r.exit_code == 1 and "config.json" in r.output, r.output
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("args, exit_code, message", [
    (["--capacities", "4,2"], 2, "must be distinct and ascending"),
    (["--capacities", "1,x"], 2, "expected comma-separated integers like 1,2,4,8"),
    (["--capacities", "0,1"], 2, "[0] are not integers in 1.."),
    (["--capacities", "64", "--max-num-tokens", "8"], 1, "raise max_num_tokens or lower the capacities"),
    (["--backend", "tensorrt-rtx", "--target", "sm120", "--max-num-tokens", "128", "--rtx-lowering", "native"], 1,
     "prefill capacities [128] exceed 64"),
])
def test_cli_refuses_invalid_capacities(args, exit_code, message, tiny_ckpt, tmp_path, no_long_work):
    if "tensorrt-rtx" in args and "tensorrt-rtx" not in registry.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    r = _cli([str(tiny_ckpt), "-o", str(tmp_path / "e"), *args])
    assert r.exit_code == exit_code and message in r.output, r.output
    assert not (tmp_path / "e").exists()


@needs_rtx
@pytest.mark.parametrize("args, message", [
    (["--backend", "tensorrt-rtx", "--target", "sm90"], "TensorRT-RTX 1.7 cannot build for sm90"),
    (["--backend", "tensorrt-rtx"], "pass --target"),
    (["--backend", "tensorrt-rtx", "--target", "volta"], "expected a GPU architecture like sm90"),
    (["--backend", "tensorrt-rtx", "--target", "sm75"], "sm75 has no bf16"),
])
def test_cli_refuses_targets_the_backend_cannot_build(args, message, tiny_ckpt, tmp_path, no_long_work):
    r = _cli([str(tiny_ckpt), "-o", str(tmp_path / "e"), "--capacities", "1", "--max-num-tokens", "4", *args])
    assert r.exit_code == 1 and message in r.output, r.output


def test_cli_refuses_an_uninstalled_backend(tiny_ckpt, tmp_path, no_long_work, monkeypatch):
    monkeypatch.setattr(registry, "installed_backends", lambda: [])
    for backend in ("tensorrt", "tensorrt-rtx"):
        r = _cli([str(tiny_ckpt), "-o", str(tmp_path / "e"), "--backend", backend, "--target", "sm120"])
        assert r.exit_code == 1 and f"backend '{backend}' is not installed; install it with" in r.output, r.output


@needs_rtx
def test_cli_refuses_too_little_disk(tiny_ckpt, tmp_path, no_long_work, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(backends.shutil, "disk_usage", lambda p: usage(1 << 40, (1 << 40) - (1 << 20), 1 << 20))
    r = _cli([str(tiny_ckpt), "-o", str(tmp_path / "e"), *RTX_ARGS, "--capacities", "1", "--max-num-tokens", "1"])
    assert r.exit_code == 1 and "not enough disk" in r.output and "0.0 GiB are free" in r.output, r.output
    assert not (tmp_path / "e").exists() and _leftovers(tmp_path / "e") == []


# ------------------------------------------------------------------------------ a real TensorRT-RTX build
