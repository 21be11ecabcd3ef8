"""Tampering: every file of an engine dir damaged, truncated, deleted or joined by an extra one,
and config.json edited, is refused with the right remedy before anything generates; damaged
checkpoints are refused at `k3trt build` with a message naming the file, the tensor and the fix.
One tiny engine per backend (torch; onnx, one graph per phase, where onnxruntime is installed) is
built per module and copied for each case."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from k3trt.builder.build import build_engine
from k3trt.cli import main as cli
from k3trt.engine.engine_dir import DIGEST_KEY, EngineDirError, config_digest, read_engine_dir, sha256_file
from k3trt.model.checkpoint_io import CheckpointError
from k3trt.model.checkpoint_check import WeightError
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from runtime_utils import build_tiny_engine, one_thread, prompts

REBUILD = "rebuild it with `k3trt build CHECKPOINT"
UNTOUCHED = "the checkpoint is untouched"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def engine(tiny_ckpt, tmp_path_factory):
    return build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("tamper") / "engine")


@pytest.fixture(scope="module")
def onnx_engine(tiny_ckpt, tmp_path_factory):
    for module in ("onnxruntime", "onnxruntime_extensions", "onnxscript"):
        pytest.importorskip(module)
    return build_engine(tiny_ckpt, tmp_path_factory.mktemp("tamper_onnx") / "engine", backend="onnx", dtype="fp32",
                        capacities=[1], max_num_tokens=1, spec_tokens=0, block_size=16)


ENGINES = {"torch": "engine", "onnx": "onnx_engine"}    # backend -> its engine fixture


@pytest.fixture(params=sorted(ENGINES))
def any_engine(request):
    return request.getfixturevalue(ENGINES[request.param])


@pytest.fixture(scope="module")
def tokens(engine):
    """What the intact engine generates (the damaged copies must never get this far)."""
    llm = LLM(engine)
    try:
        return [o.token_ids for o in llm.generate(prompts(7, [9]), SamplingParams(max_tokens=4, ignore_eos=True))]
    finally:
        llm.close()


def _all_files(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


def _refused(d: Path, *patterns: str) -> str:
    """The engine dir at `d` is refused by LLM (so nothing generates); the message has every pattern."""
    with pytest.raises(EngineDirError) as e:
        LLM(d)
    msg = str(e.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in: {msg}"
    return msg


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    for i in (0, len(data) // 2, len(data) - 1):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _truncate(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


# ------------------------------------------------------------------------------ the engine owns its files
def test_the_engine_holds_copies_of_the_checkpoint(engine, tiny_ckpt):
    for shard in sorted((engine / "rank0").glob("*.safetensors")):
        mine, theirs = shard.stat(), (tiny_ckpt / shard.name).stat()
        assert mine.st_ino != theirs.st_ino and mine.st_nlink == 1, shard.name


def test_damaging_an_engine_shard_leaves_the_checkpoint_and_the_rebuild_is_right(engine, tiny_ckpt, tokens,
                                                                               tmp_path):
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    shard = sorted((d / "rank0").glob("*.safetensors"))[0]
    before = sha256_file(tiny_ckpt / shard.name)
    _flip(shard)
    _refused(d, f"checksum of rank0/{shard.name}", REBUILD, UNTOUCHED)
    assert sha256_file(tiny_ckpt / shard.name) == before
    build_tiny_engine(tiny_ckpt, d)                      # the advice, followed
    llm = LLM(d)
    try:
        got = [o.token_ids for o in llm.generate(prompts(7, [9]), SamplingParams(max_tokens=4, ignore_eos=True))]
    finally:
        llm.close()
    assert got == tokens


# ------------------------------------------------------------------------------ every file, every damage
DAMAGE = {"flipped": _flip, "truncated": _truncate, "deleted": Path.unlink}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_file_damaged_is_refused(any_engine, tmp_path, damage):
    files = _all_files(any_engine)
    assert "config.json" in files and len(files) >= 6
    for rel in files:
        d = tmp_path / "e"
        shutil.copytree(any_engine, d)
        DAMAGE[damage](d / rel)
        if rel == "config.json":
            _refused(d, REBUILD)
        elif damage == "deleted":
            _refused(d, f"{rel} listed in config.json is missing", "copy the whole directory again", REBUILD,
                     UNTOUCHED)
        else:
            _refused(d, f"checksum of {rel}", REBUILD, UNTOUCHED)
        shutil.rmtree(d)


@pytest.mark.parametrize("extra", ["rank0/model-00009-of-00009.safetensors", "rank0/verify_b2.onnx",
                                   "tokenizer/notes.txt", "stray.bin"])
def test_an_extra_file_is_refused_by_name(any_engine, tmp_path, extra):
    d = tmp_path / "e"
    shutil.copytree(any_engine, d)
    (d / extra).write_bytes(b"\0" * 64)
    _refused(d, extra, "not listed in config.json", "remove it", REBUILD)


def test_a_symlinked_file_is_refused(engine, tiny_ckpt, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    shard = sorted((d / "rank0").glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(tiny_ckpt / shard.name)              # same bytes, but not the engine's own file
    _refused(d, f"rank0/{shard.name} is a symbolic link", REBUILD)


def test_the_onnx_graphs_are_covered(onnx_engine):
    listed = read_engine_dir(onnx_engine).files
    assert {"rank0/verify_b1.onnx", "rank0/prefill_t1.onnx", "rank0/weights.bin", "rank0/weights.json"} <= set(listed)


# ------------------------------------------------------------------------------ config.json edited
def _set(doc: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        doc = doc[p]
    doc[leaf] = value


EDITS = {
    "model.text_config.hidden_size": 96,
    "model.text_config.num_experts_per_token": 1,
    "build.dtype": "bf16",
    "build.max_seq_len": 1_000_000,
    "build.block_size": 32,
    "capacities.spec_tokens": 3,
    "capacities.verify": [1, 2, 4, 8],
    "target": "sm90",
}


@pytest.mark.parametrize("field", sorted(EDITS))
def test_an_edited_config_is_refused(any_engine, tmp_path, field):
    d = tmp_path / "e"
    shutil.copytree(any_engine, d)
    doc = json.loads((d / "config.json").read_text())
    _set(doc, field, EDITS[field])
    (d / "config.json").write_text(json.dumps(doc, indent=2))
    _refused(d, "edited after the build", "restore config.json", REBUILD, UNTOUCHED)


def test_a_files_entry_removed_is_refused(engine, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    doc = json.loads((d / "config.json").read_text())
    rel = sorted(k for k in doc["files"] if k.endswith(".safetensors"))[0]
    del doc["files"][rel]
    (d / "config.json").write_text(json.dumps(doc, indent=2))
    _refused(d, "edited after the build")
    doc[DIGEST_KEY] = config_digest(doc)                  # even re-signed: the file is then unlisted
    (d / "config.json").write_text(json.dumps(doc, indent=2))
    _flip(d / rel)
    _refused(d, rel, "not listed in config.json")


def test_the_model_block_and_rank0_config_are_one(engine, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    doc = json.loads((d / "config.json").read_text())
    doc["model"]["text_config"]["num_experts_per_token"] = 1
    doc[DIGEST_KEY] = config_digest(doc)                  # a consistent-looking edit of the model block
    (d / "config.json").write_text(json.dumps(doc, indent=2))
    _refused(d, "rank0/config.json differs from the model block", REBUILD)


def test_a_config_without_digest_is_refused(engine, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    doc = json.loads((d / "config.json").read_text())
    del doc[DIGEST_KEY]
    (d / "config.json").write_text(json.dumps(doc))
    _refused(d, DIGEST_KEY, REBUILD)


def test_the_intact_copy_loads(any_engine, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(any_engine, d)
    assert read_engine_dir(d).files == read_engine_dir(any_engine).files


# ------------------------------------------------------------------------------ checkpoint damage at build
def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX).read_text())


def _rewrite(ckpt: Path, edit) -> tuple[str, str]:
    """Rewrite the shard holding the first 2-D non-embedding tensor through edit(tensors, name) ->
    index weight_map edits; returns (shard file, tensor name)."""
    index = _index(ckpt)
    name = next(n for n in sorted(index["weight_map"]) if n.endswith("proj.weight"))
    shard = index["weight_map"][name]
    tensors = load_file(ckpt / shard)
    edit(tensors, name, index["weight_map"], shard)
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    (ckpt / INDEX).write_text(json.dumps(index))
    return shard, name


def _wrong_shape(t, name, wmap, shard):
    t[name] = t[name][:, :-1].contiguous()


def _int_dtype(t, name, wmap, shard):
    t[name] = t[name].to(torch.int32)


def _missing(t, name, wmap, shard):
    del t[name]
    del wmap[name]


def _extra(t, name, wmap, shard):
    t["model.layers.0.bogus.weight"] = t[name].clone()
    wmap["model.layers.0.bogus.weight"] = shard


TENSOR_DAMAGE = {"wrong shape": (_wrong_shape, "has shape", "fix (wrong shape or dtype)"),
                 "int dtype": (_int_dtype, "torch.int32", "fix (wrong shape or dtype)"),
                 "missing": (_missing, "missing tensor", "fix (missing)"),
                 "extra": (_extra, "unexpected tensor", "fix (unexpected)")}


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    return d


def _build_refused(ckpt: Path, out: Path, error, *patterns: str) -> str:
    with pytest.raises(error) as e:
        build_tiny_engine(ckpt, out)
    msg = str(e.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in: {msg}"
    assert not out.exists()
    return msg


@pytest.mark.parametrize("kind", sorted(TENSOR_DAMAGE))
def test_checkpoint_tensor_damage_is_refused_at_build(ckpt, tmp_path, kind):
    edit, what, fix = TENSOR_DAMAGE[kind]
    shard, name = _rewrite(ckpt, edit)
    where = str(ckpt / INDEX) if kind == "missing" else str(ckpt / shard)
    tensor = "model.layers.0.bogus.weight" if kind == "extra" else name
    _build_refused(ckpt, tmp_path / "out", WeightError, where, tensor, what, fix)


def _truncated(ckpt: Path) -> str:
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    _truncate(shard)
    return shard.name


def _deleted(ckpt: Path) -> str:
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    shard.unlink()
    return shard.name


def _bad_header(ckpt: Path) -> str:
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    return shard.name


@pytest.mark.parametrize("damage", [_truncated, _deleted, _bad_header], ids=["truncated", "missing", "bad header"])
def test_a_damaged_checkpoint_file_is_refused_at_build(ckpt, tmp_path, damage):
    shard = damage(ckpt)
    _build_refused(ckpt, tmp_path / "out", CheckpointError, shard, "download or copy the checkpoint again")


def test_a_nested_model_type_is_checked(ckpt, tmp_path):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["model_type"] = "nonsense"
    (ckpt / "config.json").write_text(json.dumps(raw))
    _build_refused(ckpt, tmp_path / "out", WeightError, str(ckpt / "config.json"), "text_config.model_type",
                   "'nonsense'", "fix:")


def test_k3trt_build_prints_the_refusal(ckpt, tmp_path):
    shard = _truncated(ckpt)
    r = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(tmp_path / "out"), "--backend", "torch"])
    assert r.exit_code == 1 and shard in r.output and "download or copy the checkpoint again" in r.output, r.output
    assert not (tmp_path / "out").exists()
