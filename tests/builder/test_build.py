"""`k3trt build` end to end: a killed build leaves nothing that loads and the next build cleans up;
content keys reuse unchanged capacities (and rebuild changed, new or damaged ones, or all with
--force). The reuse logic runs with the per-capacity export and engine build replaced by small
fakes (real ONNX files with external weights, so weight sharing and the content keys are the real
code). The CLI's refusals: test_build_cli.py; a real TensorRT-RTX build: test_build_rtx.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import k3trt.builder.build as build_mod
import k3trt.builder.rank as rank
import k3trt.builder.tensorrt as trt
import k3trt.engine.backends as registry
from k3trt.builder.build import build_engine
from k3trt.cli import main as cli
from k3trt.engine.engine_dir import EngineDirError, read_engine_dir
from k3trt.engine.writer import EngineDirBusy, build_lock

needs_rtx = pytest.mark.skipif(not __import__("importlib").util.find_spec("tensorrt_rtx_bindings"),
                               reason="TensorRT-RTX not installed (pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
                                      "tensorrt-rtx-cu13-bindings==1.7.1.116)")
RTX_ARGS = ["--backend", "tensorrt-rtx", "--target", "sm120", "--spec-tokens", "0"]


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ interrupted builds
_SLOW_BUILD = textwrap.dedent('''
    import runpy, sys, time
    import k3trt.builder.build as b
    copy = b.copy_owned
    def slow(src, dst):                      # the injected slow step: the build is killed in here
        copy(src, dst)
        print("COPIED", dst, flush=True)
        time.sleep(60)
    b.copy_owned = slow
    sys.argv = ["k3trt", *sys.argv[1:]]
    runpy.run_module("k3trt", run_name="__main__", alter_sys=True)      # = python -m k3trt ...
''')


def _start_and_kill(args: list[str], marker: str, timeout: float = 300) -> str:
    """Run `args` (a python command line), SIGKILL it when `marker` appears on stdout/stderr."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, t0 = [], time.monotonic()
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                break
            assert time.monotonic() - t0 < timeout, "".join(seen[-20:])
        else:
            pytest.fail(f"the build ended (rc {proc.wait()}) before {marker!r}:\n" + "".join(seen[-20:]))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return "".join(seen)


def test_killed_build_leaves_nothing_that_loads(tiny_ckpt, tmp_path):
    out = tmp_path / "engine"
    args = [str(tiny_ckpt), "-o", str(out), "--backend", "torch", "--dtype", "fp32", "--capacities", "1,2",
            "--max-num-tokens", "16"]
    _start_and_kill(["-c", _SLOW_BUILD, "build", *args], "COPIED")
    assert not out.exists()
    stale = [s for s in _leftovers(out) if s != ".engine.lock"]      # the lock file stays, unlocked
    assert len(stale) == 1 and stale[0].startswith(".engine.tmp-"), stale
    for d in (out, out.parent / stale[0]):
        with pytest.raises(EngineDirError, match="not an engine directory"):
            read_engine_dir(d)
    # the rerun: the real command line; it removes the leftover and says so
    r = subprocess.run([sys.executable, "-m", "k3trt", "build", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"removing {out.parent / stale[0]}: left behind by an interrupted build" in r.stderr
    assert read_engine_dir(out).backend == "torch" and _leftovers(out) == []
    before = _files(out)
    # killed while rebuilding into it: the previous complete engine dir is still what loads
    _start_and_kill(["-c", _SLOW_BUILD, "build", *args], "COPIED")
    assert _files(out) == before and read_engine_dir(out).capacities.verify == (1, 2)
    assert [s[:11] for s in _leftovers(out)] == [".engine.loc", ".engine.tmp"]
    build_engine(tiny_ckpt, out, dtype="fp32", capacities=[1, 2], max_num_tokens=16)
    assert _leftovers(out) == [] and read_engine_dir(out).backend == "torch"


def test_a_second_build_into_the_same_output_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "engine"
    with build_lock(out):
        with pytest.raises(EngineDirBusy, match=rf"another k3trt build \(pid {os.getpid()}\) is writing"):
            build_engine(tiny_ckpt, out, dtype="fp32", capacities=[1], max_num_tokens=4)
        assert _leftovers(out) == [".engine.lock"]
    assert _leftovers(out) == [] and not out.exists()


def test_rebuilding_replaces_an_engine_dir_but_nothing_else(tiny_ckpt, tmp_path):
    out = build_engine(tiny_ckpt, tmp_path / "engine", dtype="fp32", capacities=[1], max_num_tokens=4)
    build_engine(tiny_ckpt, out, dtype="fp32", capacities=[1, 2], max_num_tokens=8)
    assert read_engine_dir(out).capacities.verify == (1, 2) and _leftovers(out) == []
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not an engine directory"):
        build_engine(tiny_ckpt, tmp_path / "other", dtype="fp32", capacities=[1], max_num_tokens=4)
    assert (tmp_path / "other" / "keep.txt").read_text() == "x"


# ------------------------------------------------------------------------------ content keys (fake engines)
class FakeEngines:
    """Stands in for the per-capacity export and engine build: real ONNX graphs with two external
    tensors (`w`, the same in every graph, and `c`, one per capacity), engines of random bytes
    (real engines are not byte-reproducible either), and a record of what was built."""

    def __init__(self, monkeypatch):
        self.exported: list[str] = []
        self.built: list[str] = []
        self.loads = 0
        monkeypatch.setattr(rank, "_export", self.export)
        monkeypatch.setattr(rank, "build_engine", self.engine)
        monkeypatch.setattr(rank, "load_backend", lambda name: registry.Backend(name, None, "fake-1.0"))
        monkeypatch.setattr(registry, "installed_backends", lambda: ["tensorrt", "tensorrt-rtx"])
        monkeypatch.setattr(rank.ModelSource, "load", lambda source: self.load())

    def load(self):
        self.loads += 1
        return None, "model"

    def export(self, model, cfg, family, rank_dir, position, **_):
        """rank._export's contract: [(members, graph)]; here each member its own graph."""
        return [([spec], self.export_one(model, spec, rank_dir)) for spec in family]

    def export_one(self, model, spec, rank_dir):
        assert model == "model"
        import onnx  # noqa: PLC0415 (optional: onnx)
        from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415 (optional: onnx)

        self.exported.append(spec.name)
        w = numpy_helper.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "w")
        c = numpy_helper.from_array(np.full((64, 64), spec.capacity, dtype=np.float32), "c")
        nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "c"], ["y"])]
        graph = helper.make_graph(nodes, spec.name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w, c])
        path = rank_dir / f"{spec.name}.onnx"
        onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
                  location=f"{spec.name}.onnx.data", size_threshold=0)
        return path

    def engine(self, backend, onnx_path, engine_path, options, meta=None):
        self.built.append(onnx_path.stem)
        manifest = trt.weights_to_inputs(onnx_path, onnx_path.with_suffix(".tmp.onnx"))
        onnx_path.with_suffix(".tmp.onnx").unlink()
        engine_path.write_bytes(os.urandom(2048))
        Path(f"{engine_path}.json").write_text(json.dumps({"weights": manifest, "layers": 2, **(meta or {})}))
        return trt.EngineReport(onnx_path.stem, engine_path, 0.01, 2048, 2, tuple(m["name"] for m in manifest))


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint (tests change its files' mtimes)."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def _fake_build(ckpt, out, caps, mnt, **kw):
    return build_engine(ckpt, out, backend="tensorrt-rtx", target="sm120", capacities=caps, max_num_tokens=mnt,
                        spec_tokens=0, **kw)


def test_unchanged_capacities_are_reused(ckpt_copy, tmp_path, monkeypatch, caplog):
    fake = FakeEngines(monkeypatch)
    out = tmp_path / "engine"
    _fake_build(ckpt_copy, out, [1], 1)
    assert fake.built == ["verify_b1", "prefill_t1"] and fake.loads == 1
    first = _files(out)
    keys = read_engine_dir(out).inputs["capacities"]
    assert set(keys) == {"verify_b1", "prefill_t1"} and len(set(keys.values())) == 2

    fake.built.clear()
    caplog.clear()
    _fake_build(ckpt_copy, out, [1], 1)
    assert fake.built == [] and fake.exported == ["verify_b1", "prefill_t1"]       # nothing exported again
    assert fake.loads == 1                                                         # nor the model loaded
    assert _files(out) == first                                                    # byte-identical engines
    assert "reusing 2 of 2 capacities" in caplog.text and "6 checkpoint files unchanged" in caplog.text
    assert "0 built, 2 reused" in caplog.text

    # a changed capacity list builds only the new capacities; the new `c` goes to a new data file
    caplog.clear()
    _fake_build(ckpt_copy, out, [1, 2], 2)
    assert fake.built == ["verify_b2", "prefill_t2"]
    now = _files(out)
    for name in ("verify_b1", "prefill_t1"):
        for suffix in (".onnx", ".engine", ".engine.json"):
            assert now[f"rank0/{name}{suffix}"] == first[f"rank0/{name}{suffix}"]
    assert now["rank0/weights.bin"] == first["rank0/weights.bin"]
    table = json.loads(now["rank0/weights.json"])["tensors"]
    assert [(n, loc) for n, _, loc, _, _ in table] == [("w", "weights.bin"), ("c", "weights.bin"),
                                                      ("c", "weights.1.bin")]
    assert json.loads(now["rank0/verify_b2.engine.json"])["weights"][0]["location"] == "weights.bin"   # w shared
    ed = read_engine_dir(out)
    assert ed.capacities.verify == (1, 2) and set(ed.inputs["capacities"]) == {
        "verify_b1", "verify_b2", "prefill_t1", "prefill_t2"}
    assert "2 built, 2 reused" in caplog.text

    # damaged files are rebuilt, not copied on; the rest is still reused
    with open(out / "rank0" / "verify_b1.engine", "ab") as f:
        f.write(b"\0")
    fake.built.clear()
    _fake_build(ckpt_copy, out, [1, 2], 2)
    assert fake.built == ["verify_b1"] and "verify_b1: rebuilding: its files" in caplog.text
    read_engine_dir(out)

    # --force (through the CLI) rebuilds everything
    fake.built.clear()
    r = CliRunner().invoke(cli, ["build", str(ckpt_copy), "-o", str(out), *RTX_ARGS, "--capacities", "1,2",
                                 "--max-num-tokens", "2", "--force"])
    assert r.exit_code == 0, r.output
    assert fake.built == ["verify_b1", "verify_b2", "prefill_t1", "prefill_t2"]
    assert "--force: rebuilding every capacity" in caplog.text


def test_changed_inputs_rebuild(ckpt_copy, tmp_path, monkeypatch, caplog):
    fake = FakeEngines(monkeypatch)
    out = tmp_path / "engine"
    _fake_build(ckpt_copy, out, [1], 1)
    # a touched checkpoint file is hashed again; same content: still reused
    shard = sorted(ckpt_copy.glob("*.safetensors"))[0]
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
    fake.built.clear()
    caplog.clear()
    _fake_build(ckpt_copy, out, [1], 1)
    assert f"hashing checkpoint file {shard.name}" in caplog.text and fake.built == []
    # other code, other block size, other weights: rebuilt
    for change in ("code", "block_size", "weights"):
        fake.built.clear()
        kw = {}
        if change == "code":
            monkeypatch.setattr(build_mod, "code_digest", lambda: "0" * 64)
        elif change == "block_size":
            kw = {"block_size": 32}
        else:
            with open(shard, "r+b") as f:          # one weight byte past the safetensors header
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
        _fake_build(ckpt_copy, out, [1], 1, **kw)
        assert fake.built == ["verify_b1", "prefill_t1"], change
        if change == "block_size":      # back to the default for the next change
            _fake_build(ckpt_copy, out, [1], 1)


# ------------------------------------------------------------------------------ bad input, through the CLI
