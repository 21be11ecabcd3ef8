"""Safetensors checkpoint writer/reader: bitwise round trips, determinism, and clear errors."""

from __future__ import annotations

import json
import logging
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3trt.model import checkpoint_io as cio
from k3trt.model import checkpoint_write as ciow
from k3trt.model.checkpoint_io import INDEX_NAME, CheckpointError, CheckpointReader, MissingTensorError
from k3trt.model.checkpoint_write import write_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "model.embed_tokens.weight": r(16, 8).to(torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": r(8, 8).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": r(1, 1).abs(),
        "model.layers.0.norm.weight": r(8).to(torch.float16),
        "model.layers.0.A_log": r(3, 1, 2).double(),
        "model.layers.0.packed": torch.randint(0, 256, (4, 5), generator=g, dtype=torch.uint8),
        "model.layers.0.ids": torch.randint(-2**40, 2**40, (3,), generator=g),
        "model.layers.0.i32": torch.randint(-9, 9, (2, 3), generator=g, dtype=torch.int32),
        "model.layers.0.i8": torch.randint(-9, 9, (7,), generator=g, dtype=torch.int8),
        "model.layers.0.mask": torch.rand(5, generator=g) > 0.5,
        "model.layers.0.e5m2": r(3, 3).to(torch.float8_e5m2),
        "model.scalar": torch.tensor(3.5),
        "model.empty": torch.zeros(0, 4),
        "model.transposed": r(6, 4).t(),  # non-contiguous input
        "vision_tower.blocks.0.weight": r(4, 4),
        "mm_projector.proj.weight": r(2, 4),
    }


def _bits(t: torch.Tensor) -> tuple:
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    return t.dtype, tuple(t.shape), raw.tolist()


def _ckpt(tmp_path, tensors=None, max_shard_bytes=300, **kw):
    tensors = _tensors() if tensors is None else tensors
    d = tmp_path / "ckpt"
    write_checkpoint(d, tensors, max_shard_bytes=max_shard_bytes, **kw)
    return d, tensors


def test_round_trip_is_bitwise(tmp_path):
    d, tensors = _ckpt(tmp_path)
    with CheckpointReader(d) as r:
        assert r.names() == sorted(tensors)
        for name, t in tensors.items():
            assert (r.dtype(name), r.shape(name)) == (t.dtype, tuple(t.shape))
            assert _bits(r.get(name)) == _bits(t), name
        assert r.unconsumed() == []
    # safetensors itself reads every shard back identically (an independent parser).
    index = json.loads((d / INDEX_NAME).read_text())
    for shard in set(index["weight_map"].values()):
        for name, t in load_file(d / shard).items():
            assert _bits(t) == _bits(tensors[name]), name


def test_sharding_follows_order_and_limit(tmp_path):
    ts = {f"t{i}": torch.zeros(25, dtype=torch.float32) for i in range(5)}  # 100 bytes each
    ts["big"] = torch.zeros(100, dtype=torch.float32)                         # 400 > limit
    ts["tail"] = torch.zeros(1, dtype=torch.float32)
    paths = write_checkpoint(tmp_path, ts, max_shard_bytes=250, metadata={"format": "k3"})
    assert [p.name for p in paths] == [cio.shard_name(i, 5) for i in range(1, 6)] + [INDEX_NAME]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"] == {"format": "k3", "total_size": 5 * 100 + 400 + 4}
    got = {n: int(s[6:11]) for n, s in index["weight_map"].items()}
    assert got == {"t0": 1, "t1": 1, "t2": 2, "t3": 2, "t4": 3, "big": 4, "tail": 5}


def test_same_input_same_bytes(tmp_path):
    a, _ = _ckpt(tmp_path / "a")
    b, _ = _ckpt(tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) > 2
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    _, meta = cio.read_safetensors_header(a / cio.shard_name(1, len(files) - 1))
    assert meta == {"format": "pt"}


def test_rewrite_removes_stale_shards(tmp_path):
    d, _ = _ckpt(tmp_path, max_shard_bytes=100)
    assert len(list(d.glob("*.safetensors"))) > 2
    write_checkpoint(d, {"x": torch.ones(2)}, max_shard_bytes=100)
    assert sorted(p.name for p in d.iterdir()) == sorted([INDEX_NAME, cio.shard_name(1, 1)])
    with CheckpointReader(d) as r:
        assert r.names() == ["x"]


def test_interrupted_write_leaves_no_valid_looking_file(tmp_path, monkeypatch):
    def boom(f, t):
        f.write(b"\0" * 3)
        raise KeyboardInterrupt
    monkeypatch.setattr(ciow, "_write_tensor_bytes", boom)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, {"x": torch.ones(4)}, max_shard_bytes=100)
    assert list(tmp_path.iterdir()) == []
    # Rewriting over a checkpoint drops its index first, so an interruption leaves no index.
    monkeypatch.undo()
    d, _ = _ckpt(tmp_path)
    monkeypatch.setattr(ciow, "_write_tensor_bytes", boom)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(d, _tensors(), max_shard_bytes=300)
    assert not (d / INDEX_NAME).exists() and not list(d.glob(".*partial"))
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        CheckpointReader(d)


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no tensors"):
        write_checkpoint(tmp_path, {}, max_shard_bytes=10)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_checkpoint(tmp_path, {"x": torch.ones(1)}, max_shard_bytes=0)
    with pytest.raises(TypeError, match="x: dtype"):
        write_checkpoint(tmp_path, {"x": torch.ones(1, dtype=torch.complex128)}, max_shard_bytes=10)


def test_single_file_checkpoint(tmp_path):
    ts = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    save_file(ts, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as r:
        assert r.shards == ("model.safetensors",) and r.names() == ["a", "b"]
        assert torch.equal(r.get("a"), ts["a"])
        assert r.unconsumed() == ["b"]


def test_unconsumed_and_metadata_queries_do_not_consume(tmp_path):
    d, tensors = _ckpt(tmp_path)
    with CheckpointReader(d) as r:
        assert "model.scalar" in r and "nope" not in r and len(r) == len(tensors)
        r.shape("model.scalar"), r.dtype("model.scalar"), r.info("model.scalar")
        assert r.unconsumed() == sorted(tensors)
        r.get("model.scalar")
        r.get("model.scalar")  # reading twice is allowed
        assert r.unconsumed() == sorted(set(tensors) - {"model.scalar"})


def test_skip_prefixes(tmp_path, caplog):
    d, tensors = _ckpt(tmp_path)
    with CheckpointReader(d) as r, caplog.at_level(logging.INFO, logger=cio.__name__):
        skipped = r.skip_prefixes(["vision_tower.", "mm_projector.", "audio."])
        assert skipped == ["mm_projector.proj.weight", "vision_tower.blocks.0.weight"]
        assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in r.unconsumed())
        assert len(r.unconsumed()) == len(tensors) - 2
        with pytest.raises(TypeError):
            r.skip_prefixes("vision_tower.")
    assert "skipped 2 tensors" in caplog.text and "vision_tower.* (1)" in caplog.text


def test_missing_tensor_names_tensor_and_dir(tmp_path):
    d, _ = _ckpt(tmp_path)
    with CheckpointReader(d) as r:
        with pytest.raises(MissingTensorError) as e:
            r.get("model.layers.0.norm.weigth")
        assert isinstance(e.value, KeyError)
        msg = str(e.value)
        assert "model.layers.0.norm.weigth" in msg and str(d) in msg
        assert "model.layers.0.norm.weight" in msg  # the close match
        with pytest.raises(KeyError, match="nope"):
            r.shape("nope")


def test_progress_logged_per_shard(tmp_path, caplog):
    d, _ = _ckpt(tmp_path)
    with caplog.at_level(logging.DEBUG, logger=cio.__name__), CheckpointReader(d) as r:
        for n in r.names():
            r.get(n)
    n = len(list(d.glob("*.safetensors")))
    assert sum("loading shard" in m for m in caplog.messages) == n


def test_close(tmp_path):
    d, tensors = _ckpt(tmp_path)
    r = CheckpointReader(d)
    t = r.get("model.scalar")
    r.close()
    assert t.item() == 3.5
    with pytest.raises(RuntimeError, match="closed"):
        r.get("model.empty")


# --------------------------------------------------------------------------- corrupt inputs
def _shard_of(d, name):
    return d / json.loads((d / INDEX_NAME).read_text())["weight_map"][name]


def test_missing_index_and_single(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        CheckpointReader(tmp_path)


def test_missing_shard(tmp_path):
    d, _ = _ckpt(tmp_path)
    shard = _shard_of(d, "model.scalar")
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard file .*{shard.name} is missing"):
        CheckpointReader(d)


def test_tensor_in_index_but_not_in_shard(tmp_path):
    d, _ = _ckpt(tmp_path)
    index = json.loads((d / INDEX_NAME).read_text())
    shard = index["weight_map"]["model.scalar"]
    index["weight_map"]["model.layers.9.ghost.weight"] = shard
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"'model.layers.9.ghost.weight' is mapped to .*{shard}"):
        CheckpointReader(d)


def test_tensor_in_shard_but_not_in_index(tmp_path):
    d, _ = _ckpt(tmp_path)
    index = json.loads((d / INDEX_NAME).read_text())
    shard = index["weight_map"].pop("model.scalar")
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{shard}: holds tensor 'model.scalar'"):
        CheckpointReader(d)


def test_index_not_json(tmp_path):
    d, _ = _ckpt(tmp_path)
    (d / INDEX_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable index"):
        CheckpointReader(d)


def _write_raw(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize("case, pattern", [
    ("truncated", "run past the end of the file"),
    ("tiny", "truncated: 5 bytes"),
    ("garbage", "does not fit a"),
    ("bad_json", "not valid UTF-8 JSON"),
    ("past_eof", "'w': data_offsets \\[0, 4096\\] run past the end"),
    ("bad_dtype", "unsupported dtype 'Q7'"),
    ("size_mismatch", "span 8 bytes, but F32\\[4\\] needs 16"),
    ("gap", "starts at 8, expected 0"),
    ("trailing", "4 trailing bytes"),
])
def test_corrupt_shard_errors_name_file_and_fault(tmp_path, case, pattern):
    d, _ = _ckpt(tmp_path)
    shard = _shard_of(d, "model.embed_tokens.weight")
    w = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    if case == "truncated":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif case == "tiny":
        shard.write_bytes(b"\x01\x02\x03\x04\x05")
    elif case == "garbage":
        shard.write_bytes(bytes(range(7, 255)) * 3)
    elif case == "bad_json":
        _write_raw(shard, b"{\"w\": [1, 2" + b" " * 5)
    elif case == "past_eof":
        _write_raw(shard, {"w": {**w, "shape": [1024], "data_offsets": [0, 4096]}}, b"\0" * 16)
    elif case == "bad_dtype":
        _write_raw(shard, {"w": {**w, "dtype": "Q7"}}, b"\0" * 16)
    elif case == "size_mismatch":
        _write_raw(shard, {"w": {**w, "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "gap":
        _write_raw(shard, {"w": {**w, "data_offsets": [8, 24]}}, b"\0" * 24)
    elif case == "trailing":
        _write_raw(shard, {"w": w}, b"\0" * 20)
    with pytest.raises(CheckpointError, match=pattern) as e:
        CheckpointReader(d)
    assert shard.name in str(e.value) and "corrupt safetensors file" in str(e.value)
