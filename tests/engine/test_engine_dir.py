"""The engine directory: build → read round trip, and the refusals (format version, checksum,
missing file, backend, bad build options), each with a message that says what to do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from k3trt.builder.build import build_engine
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.engine_dir import DIGEST_KEY, FORMAT_VERSION, EngineDirError, config_digest, read_engine_dir
from k3trt.config import ModelConfig
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from runtime_utils import assert_no_leak, build_tiny_engine, one_thread, prompts


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def engine(tiny_ckpt, tmp_path_factory):
    return build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("enginedir") / "engine")


@pytest.fixture
def copy(engine, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(engine, dst)
    return dst


def test_round_trip(engine, tiny_ckpt):
    ed = read_engine_dir(engine)
    assert ed.backend == "torch" and ed.model == ModelConfig.from_json(tiny_ckpt)
    assert ed.build == BuildConfig(dtype="fp32", block_size=16, max_num_tokens=32,
                                   max_seq_len=ed.model.max_position_embeddings)
    assert ed.capacities.verify == (1, 2, 4) and ed.capacities.prefill == (1, 2, 4, 8, 16, 32)
    assert ed.capacities.spec_tokens == 0
    assert (ed.rank_dir / "config.json").is_file() and ed.tokenizer_dir is not None
    on_disk = {p.relative_to(engine).as_posix() for p in engine.rglob("*") if p.is_file()}
    assert set(ed.files) == on_disk - {"config.json"}
    assert not list(engine.parent.glob(".engine.*")), "temporary build dir left behind"


def _edit(d, **changes):
    """Change config.json and record its new digest: a refusal other than the digest's is tested."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    cfg[DIGEST_KEY] = config_digest(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def test_refuses_other_format_version(copy):
    _edit(copy, format_version=FORMAT_VERSION + 1)
    with pytest.raises(EngineDirError, match=r"format version .*k3trt build"):
        read_engine_dir(copy)


def test_refuses_changed_file(copy):
    shard = next((copy / "rank0").glob("*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(EngineDirError, match=rf"checksum of rank0/{shard.name}"):
        read_engine_dir(copy)
    read_engine_dir(copy, verify_checksums=False)      # the escape hatch, for trusted copies


def test_refuses_missing_file(copy):
    (copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(EngineDirError, match="tokenizer/tokenizer.json .* missing"):
        read_engine_dir(copy)


def test_refuses_other_backend(copy):
    with pytest.raises(EngineDirError, match="--backend tensorrt"):
        read_engine_dir(copy, backend="tensorrt")
    _edit(copy, backend="tensorrt")
    with pytest.raises(EngineDirError, match="built for the 'tensorrt' backend"):
        LLM(copy)
    _edit(copy, backend="openvino")
    with pytest.raises(EngineDirError, match="unknown backend"):
        read_engine_dir(copy)


def test_refuses_non_engine_dirs(tmp_path, tiny_ckpt):
    with pytest.raises(EngineDirError, match="not an engine directory"):
        read_engine_dir(tmp_path)
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "backend": "torch"}))
    with pytest.raises(EngineDirError, match="malformed"):
        read_engine_dir(d)


def test_build_refusals(tiny_ckpt, engine, tmp_path):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an engine directory"):
        build_tiny_engine(tiny_ckpt, occupied)          # an engine dir may be rebuilt; anything else is kept
    assert (occupied / "notes.txt").read_text() == "mine"
    occupied.joinpath("notes.txt").unlink()
    occupied.rmdir()
    with pytest.raises(ValueError, match="kv_dtype"):
        build_tiny_engine(tiny_ckpt, tmp_path / "a", kv_dtype="bf16")          # with dtype fp32
    with pytest.raises(ValueError, match="max_num_tokens"):
        build_engine(tiny_ckpt, tmp_path / "b", capacities=[1, 2, 4], max_num_tokens=8, spec_tokens=3)
    with pytest.raises(ValueError, match="capacities"):
        build_engine(tiny_ckpt, tmp_path / "c", capacities=[4, 2])
    with pytest.raises(RuntimeError, match="backend 'tensorrt' is not installed; install it with"):
        build_engine(tiny_ckpt, tmp_path / "d", backend="tensorrt")      # never installable here
    with pytest.raises(ValueError, match="unknown backend 'openvino'"):
        build_engine(tiny_ckpt, tmp_path / "e", backend="openvino")
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".*"))


def test_fp8_kv_cache_runs(tiny_ckpt, tmp_path):
    d = build_tiny_engine(tiny_ckpt, tmp_path / "fp8", kv_dtype="fp8")
    llm = LLM(d)
    assert all(t.dtype == torch.float8_e4m3fn for t in llm.session.cache.mla.values())
    outs = llm.generate(prompts(41, [20, 7]), SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert_no_leak(llm)
