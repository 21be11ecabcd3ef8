"""Images through the Triton engine model, in process: the model's own code (EngineModel) with a
stand-in for Triton's `triton_python_backend_utils` and the tiny preset's MoonViT tower
(a real tritonserver runs the model in a stub process, out of the fixture's reach). An `images`
input with `text_input` or `messages` generates deterministically; a corrupt image is refused
naming `images` and the model serves the next request."""

from __future__ import annotations

import json
import sys
import threading
import types

import numpy as np
import pytest
from runtime_utils import assert_idle_and_no_leak, one_thread, png

pytest.importorskip("starlette")      # k3trt.serve, which the engine model runs on

from k3trt.triton.engine_model import EngineModel
from k3trt.triton.schema import INPUT_NAMES

FINAL = 1


class _Tensor:
    def __init__(self, name: str, arr: np.ndarray):
        self._name, self._arr = name, arr

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._arr


class _Error:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = range(4)

    def __init__(self, message: str, code: int):
        self.text, self.code = message, code


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.outputs = {t.name(): t.as_numpy().reshape(-1)[0] for t in output_tensors or []}
        self.error = error


def _pb() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Logger = types.SimpleNamespace(**{k: (lambda msg: None) for k in
                                         ("log_info", "log_warn", "log_error", "log_verbose")})
    pb.Tensor, pb.InferenceResponse, pb.TritonError = _Tensor, _Response, _Error
    pb.TritonModelException = RuntimeError
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    return pb


class _Request:
    """One request's inputs and the responses sent for it."""

    def __init__(self, rid: str, **inputs):
        assert set(inputs) <= INPUT_NAMES
        self.rid, self.responses, self.done = rid, [], threading.Event()
        self._inputs = {k: np.array(v if isinstance(v, list) else [v],
                                    dtype=object if isinstance(v, (str, bytes, list)) else None)
                        for k, v in inputs.items()}

    def inputs(self):
        return [_Tensor(k, v) for k, v in self._inputs.items()]

    def request_id(self) -> str:
        return self.rid

    def parameters(self) -> str:
        return "{}"

    def get_response_sender(self):
        return self

    def is_cancelled(self) -> bool:
        return False

    def send(self, response, flags=0) -> None:
        self.responses.append(response)
        if flags & FINAL:
            self.done.set()

    def final(self) -> _Response:
        assert self.done.wait(60), "no final response"
        return self.responses[-1]


def _run(model: EngineModel, **inputs) -> _Response:
    req = _Request("r", max_tokens=np.int32(5), temperature=np.float32(0.0), **inputs)
    try:
        model.execute([req])
    except RuntimeError:        # a refusal in `execute` raises too (Triton counts it as a failure)
        pass
    return req.final()


@pytest.fixture
def model(engine, vision, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb())
    m = EngineModel()
    with one_thread():
        m.initialize({"model_config": json.dumps({"name": "k3"}), "model_instance_kind": "CPU"},
                     {"engine_dir": str(engine), "engine_options": json.dumps({"verify_checksums": False})})
        yield m
        m.finalize()


def test_images_input(model):
    text = [_run(model, text_input="<|media_pad|> Describe it.", images=[png(1)]) for _ in range(2)]
    assert text[0].error is None and text[0].outputs["completion_tokens"] == 5
    assert text[0].outputs["text_output"] == text[1].outputs["text_output"]
    plain = _run(model, text_input="<|media_pad|> Describe it.")          # the marker, no image: text
    assert text[0].outputs["prompt_tokens"] == plain.outputs["prompt_tokens"] + 3

    msgs = json.dumps([{"role": "user", "content": "Compare them."}])
    chat = [_run(model, messages=msgs, images=[png(1), png(2, 112, 56)]) for _ in range(2)]
    assert chat[0].error is None and chat[0].outputs["completion_tokens"] == 5
    assert chat[0].outputs["text_output"] == chat[1].outputs["text_output"]
    alone = _run(model, messages=msgs)
    assert chat[0].outputs["prompt_tokens"] == alone.outputs["prompt_tokens"] + 2 * 4 + 4 + 8

    for inputs, match in [(dict(text_input="<|media_pad|>", images=[b"corrupt"]), "images: image 0: image data is not an image in a supported format"),
                          (dict(text_input="no marker", images=[png(1)]), "0 image placeholders"),
                          (dict(messages=json.dumps([{"role": "system", "content": "x"}]), images=[png(1)]),
                           "images need a user message")]:
        bad = _run(model, **inputs)
        assert bad.error is not None and bad.error.text.startswith("invalid request: ") and match in bad.error.text
        again = _run(model, text_input="<|media_pad|> Describe it.", images=[png(1)])
        assert again.outputs["text_output"] == text[0].outputs["text_output"]
    assert_idle_and_no_leak(model.llm)
