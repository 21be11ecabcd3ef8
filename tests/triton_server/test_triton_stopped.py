"""A stopped multi-rank engine under the Triton engine model, in process (test_triton_images.py's
stand-in for `triton_python_backend_utils`; a real tritonserver runs the model in a stub process,
out of the test's reach): once a rank has died, the request in flight and every request after it
get an UNAVAILABLE error naming the rank within seconds, never a hang."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import pytest
from runtime_utils import one_thread
from test_triton_images import _Error, _pb, _Request

from k3trt.triton.engine_model import EngineModel

WITHIN_S = 20           # a dead rank is seen at the next collective or health check


@pytest.fixture
def model(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb())
    m = EngineModel()
    options = {"verify_checksums": False, "tp": 2, "rank_timeout_s": 60}
    with one_thread():
        m.initialize({"model_config": json.dumps({"name": "k3"}), "model_instance_kind": "CPU"},
                     {"engine_dir": str(engine), "engine_options": json.dumps(options)})
        yield m
        m.finalize()
    assert not any(r["alive"] for r in m.llm.health()["ranks"][1:])


def _request(rid: str, max_tokens: int, **inputs) -> _Request:
    return _Request(rid, text_input="Once upon a time", max_tokens=np.int32(max_tokens),
                    temperature=np.float32(0.0), **inputs)


def _kill_rank_one(model: EngineModel) -> float:
    proc = model.llm.session.group.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    return time.monotonic()


def _assert_released(model: EngineModel) -> None:
    """Every admitted request given back (its run closes just after its final response)."""
    deadline = time.monotonic() + 10
    while model.engine.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.engine.pending == 0


def _assert_unavailable(req: _Request) -> None:
    err = req.final().error
    assert err is not None and err.code == _Error.UNAVAILABLE, err and err.text
    assert err.text.startswith("unavailable: the engine is unavailable: ") and "rank 1 exited with code -9" in err.text


def test_requests_after_a_rank_died_idle_are_refused(model):
    ok = _request("ok", 2)
    model.execute([ok])
    assert ok.final().error is None
    t0 = _kill_rank_one(model)               # while idle: only the health check can tell
    for i in range(2):
        later = _request(f"later{i}", 4)
        with pytest.raises(RuntimeError, match="unavailable: the engine is unavailable: .*rank 1 exited"):
            model.execute([later])           # refused in execute: counted as failed, nothing admitted
        _assert_unavailable(later)
    assert time.monotonic() - t0 < WITHIN_S
    _assert_released(model)


def test_a_request_in_flight_when_a_rank_dies_ends_unavailable(model):
    flying = _request("flying", 200, stream=True)
    model.execute([flying])
    deadline = time.monotonic() + 60
    while not flying.responses and time.monotonic() < deadline:     # generating: a delta came out
        time.sleep(0.01)
    assert flying.responses and not flying.done.is_set()
    t0 = _kill_rank_one(model)
    _assert_unavailable(flying)
    assert time.monotonic() - t0 < WITHIN_S
    _assert_released(model)
