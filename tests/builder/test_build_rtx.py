"""A real TensorRT-RTX build through `k3trt build`, which the torch runtime then refuses with the
reason: what each machine is told, rebuilds reuse unchanged engines; parallel worker processes give
the serial build's files and a killed build leaves nothing that loads (`slow`). One build (two
engines) runs in the default suite."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import k3trt.engine.backends as registry
from k3trt.cli import main as cli
from k3trt.engine.engine_dir import EngineDirError, read_engine_dir
from k3trt.runtime.llm import LLM
from k3trt.runtime.trt_session import EngineNotRunnable, TrtSession


from test_build import RTX_ARGS, needs_rtx, _files, _leftovers, _start_and_kill  # noqa: E402


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
