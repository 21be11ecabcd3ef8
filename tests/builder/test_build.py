"""`k3trt build` end to end: a killed build leaves nothing that loads and the next build cleans up;
content keys reuse unchanged capacities (and rebuild changed, new or damaged ones, or all with
--force); parallel worker processes give the serial build's files; a real TensorRT-RTX build
through the CLI, which the torch runtime then refuses with the reason; bad input refused before
any long work.

Most reuse logic runs with the per-capacity export and engine build replaced by small fakes (real
ONNX files with external weights, so weight sharing and the content keys are the real code);
one real TensorRT-RTX build (two engines) runs in the default suite, the rest are `slow`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import k3trt.builder.backends as backends
import k3trt.builder.build as build_mod
import k3trt.builder.rank as rank
import k3trt.builder.tensorrt as trt
import k3trt.engine.backends as registry
from k3trt.builder.build import build_engine
from k3trt.cli import main as cli
from k3trt.engine.engine_dir import EngineDirError, read_engine_dir
from k3trt.engine.writer import EngineDirBusy, build_lock
from k3trt.runtime.llm import LLM
from k3trt.runtime.trt_session import EngineNotRunnable, TrtSession

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
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _cli_logged(args):
    handler = _Records()
    logger = logging.getLogger("k3trt")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        r = CliRunner().invoke(cli, args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return r, "\n".join(handler.lines), time.perf_counter() - t0


@pytest.fixture(scope="module")
def rtx_engine(tiny_ckpt, tmp_path_factory):
    """`k3trt build --backend tensorrt-rtx` of the smallest plan: verify B=1 (1 row) and prefill T=1."""
    pytest.importorskip("tensorrt_rtx_bindings")
    out = tmp_path_factory.mktemp("rtx") / "engine"
    r, logs, seconds = _cli_logged(["build", str(tiny_ckpt), "-o", str(out), *RTX_ARGS, "--capacities", "1",
                                    "--max-num-tokens", "1"])
    assert r.exit_code == 0, r.output + logs[-3000:]
    return out, r, logs, seconds


def test_rtx_build_through_the_cli(rtx_engine):
    out, r, logs, _ = rtx_engine
    assert r.output.strip().endswith(str(out))
    ed = read_engine_dir(out)
    assert ed.backend == "tensorrt-rtx" and ed.target == "sm120"
    assert {"rank0/verify_b1.engine", "rank0/prefill_t1.engine", "rank0/weights.bin"} <= set(ed.files)
    table = logs[logs.index("2 tensorrt-rtx engines (target sm120):"):]
    for row in ("capacity", "verify B=1", "verify_b1.engine", "prefill T=1", "prefill_t1.engine",
                "2 built, 0 reused"):
        assert row in table, table


def test_the_torch_runtime_refuses_the_rtx_engine_dir_with_the_reason(rtx_engine):
    out = rtx_engine[0]
    reason = registry.runnable_here("tensorrt-rtx", "sm120")
    with pytest.raises(EngineDirError, match="built for the 'tensorrt-rtx' backend \\(target sm120\\)") as e:
        LLM(out)
    assert (reason or "could run it") in str(e.value) and "--backend torch" in str(e.value)
    r = CliRunner().invoke(cli, ["run", str(out), "-p", "hello"])
    assert r.exit_code == 1 and "tensorrt-rtx" in r.output and "--backend torch" in r.output, r.output


def test_what_each_machine_is_told(rtx_engine, monkeypatch):
    """The refusals on other machines (the GPU query faked): an H200 (sm90), an RTX 4090 (sm89),
    an RTX 5090 (sm120: it runs the engines, through TrtSession on device cuda). TrtSession
    refuses before any CUDA or TensorRT call."""
    ed = read_engine_dir(rtx_engine[0])
    kw = dict(backend=ed.backend, target=ed.target, verify=ed.capacities.verify, prefill=ed.capacities.prefill,
              spec_tokens=0, max_seq_len=64, dtype=None, kv_dtype=None)
    for gpu, message in ((None, "it has no CUDA GPU"),
                         ("sm90", "its GPU is sm90, and TensorRT-RTX runs only on sm75, sm80"),
                         ("sm89", "its GPU is sm89 and the engines were built for sm120")):
        monkeypatch.setattr(registry, "local_gpu_target", lambda: gpu)
        with pytest.raises(EngineNotRunnable, match=message):
            TrtSession(ed.rank_dir, ed.model, None, **kw)
        with pytest.raises(EngineDirError, match=f"this machine cannot run it: {message}"):
            LLM(ed.path)
    monkeypatch.setattr(registry, "local_gpu_target", lambda: "sm120")
    with pytest.raises(ValueError, match="run on the GPU: use device cuda"):
        LLM(ed.path)                      # runnable there: LLM opens it with TrtSession, on the GPU


def test_rtx_rebuild_reuses_every_unchanged_engine(rtx_engine, tiny_ckpt):
    out, _, _, first_seconds = rtx_engine
    before = _files(out)
    r, logs, seconds = _cli_logged(["build", str(tiny_ckpt), "-o", str(out), *RTX_ARGS, "--capacities", "1",
                                    "--max-num-tokens", "1"])
    assert r.exit_code == 0, r.output + logs[-3000:]
    assert "reusing 2 of 2 capacities" in logs and "0 built, 2 reused" in logs
    assert _files(out) == before                     # the same engines, byte for byte
    assert seconds < first_seconds / 3, (seconds, first_seconds)


# ------------------------------------------------------------------------------ slow: more real builds
@needs_rtx
@pytest.mark.slow
def test_rtx_changed_capacities_rebuild_only_the_new_ones(rtx_engine, tiny_ckpt, tmp_path):
    out = Path(shutil.copytree(rtx_engine[0], tmp_path / "engine"))
    before = _files(out)
    r, logs, _ = _cli_logged(["build", str(tiny_ckpt), "-o", str(out), *RTX_ARGS, "--capacities", "1,2",
                              "--max-num-tokens", "2"])
    assert r.exit_code == 0, r.output + logs[-3000:]
    assert "reusing 2 of 4 capacities" in logs and "2 built, 2 reused" in logs
    built = [line for line in logs.splitlines() if ": building tensorrt-rtx engine" in line]
    assert [b.split(":")[0] for b in built] == ["verify_b2", "prefill_t2"]
    now = _files(out)
    for f in ("rank0/verify_b1.engine", "rank0/prefill_t1.engine", "rank0/weights.bin"):
        assert now[f] == before[f]
    assert read_engine_dir(out).capacities.verify == (1, 2)


@needs_rtx
@pytest.mark.slow
def test_parallel_workers_give_the_serial_build(rtx_engine, tiny_ckpt, tmp_path):
    """2 spawned workers on the two tiny RTX engines: the same graphs, weights and manifests as the
    serial build, byte for byte; the engines the same size (TensorRT-RTX orders their I/O tensors
    differently from run to run, serial or parallel alike)."""
    serial = rtx_engine[0]
    out = tmp_path / "engine"
    r, logs, seconds = _cli_logged(["build", str(tiny_ckpt), "-o", str(out), *RTX_ARGS, "--capacities", "1",
                                    "--max-num-tokens", "1", "--workers", "2"])
    assert r.exit_code == 0, r.output + logs[-3000:]
    assert "on 2 worker processes" in logs
    a, b = _files(serial), _files(out)
    assert sorted(a) == sorted(b)
    for name in a:
        if name.endswith(".engine"):
            assert len(a[name]) == len(b[name]), name
        elif name != "config.json":
            assert a[name] == b[name], name
    ca, cb = (json.loads(x["config.json"]) for x in (a, b))
    assert ca["inputs"] == cb["inputs"]
    assert {k: v for k, v in ca["files"].items() if not k.endswith(".engine")} == \
        {k: v for k, v in cb["files"].items() if not k.endswith(".engine")}


@needs_rtx
@pytest.mark.slow
def test_killed_rtx_build_leaves_nothing_that_loads(tiny_ckpt, tmp_path):
    """`python -m k3trt build --backend tensorrt-rtx` killed while TensorRT-RTX builds its first
    engine; the rerun cleans up and succeeds."""
    out = tmp_path / "engine"
    args = ["-m", "k3trt", "build", str(tiny_ckpt), "-o", str(out), *RTX_ARGS, "--capacities", "1",
            "--max-num-tokens", "1"]
    log_ = _start_and_kill(args, "verify_b1: building tensorrt-rtx engine")
    assert "engine dir written" not in log_
    assert not out.exists() and [s[:11] for s in _leftovers(out)] == [".engine.loc", ".engine.tmp"]
    with pytest.raises(EngineDirError):
        read_engine_dir(out)
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "left behind by an interrupted build" in r.stderr and "2 built, 0 reused" in r.stderr
    assert read_engine_dir(out).backend == "tensorrt-rtx" and _leftovers(out) == []
