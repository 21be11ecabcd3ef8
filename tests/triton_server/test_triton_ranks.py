"""One Triton instance owning a two-rank engine (TP2 x EP2 rank dirs, gloo): a real `tritonserver`
serves it beside the one-rank build of the same checkpoint, and both answer the same greedy text.
Skipped where the multi-rank runtime is not installed, or the server cannot be installed."""

from __future__ import annotations

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("k3trt.runtime.rank_session", reason="needs the multi-rank runtime")

from k3trt.builder.build import build_engine  # noqa: E402
from k3trt.parallel import ParallelConfig  # noqa: E402
from k3trt.triton import launch, write_model_repository  # noqa: E402

BUILD = dict(dtype="fp32", capacities=[1, 2], max_num_tokens=32, spec_tokens=0, block_size=16)


def _text(server, model: str, prompt: str) -> str:
    values = {"text_input": (np.array([prompt.encode()], dtype=object), "BYTES"),
              "max_tokens": (np.array([8], dtype=np.int32), "INT32"),
              "temperature": (np.array([0.0], dtype=np.float32), "FP32")}
    inputs = []
    for name, (arr, kind) in values.items():
        t = httpclient.InferInput(name, list(arr.shape), kind)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client = httpclient.InferenceServerClient(server.http, network_timeout=120)
    try:
        res = client.infer(f"{model}_unary", inputs)
    finally:
        client.close()
    return res.as_numpy("text_output").reshape(-1)[0].decode()


@pytest.mark.slow
def test_one_instance_serves_a_two_rank_engine(tiny_ckpt, tmp_path):
    try:
        site = launch.pytriton_site(launch.default_cache())
        env = launch.stub_env(launch.default_cache())
    except Exception as e:      # no package index and no cached wheel: the only reason to skip
        pytest.skip(f"cannot install {launch.PYTRITON} or numpy<2 for the backend stub: {e}")
    one = build_engine(tiny_ckpt, tmp_path / "one", **BUILD)
    two = build_engine(tiny_ckpt, tmp_path / "two", parallel=ParallelConfig(tp=2, ep=2), **BUILD)
    common = dict(execution_env=env, torch_threads=1, device="cpu",
                  engine_options={"verify_checksums": False})
    write_model_repository(one, tmp_path / "repo", model_name="k3", **common)
    model = write_model_repository(two, tmp_path / "repo", model_name="k3tp2", **common)
    assert "count: 1 kind: KIND_CPU" in (model / "config.pbtxt").read_text()
    with launch.TritonServer(tmp_path / "repo", site, log_path=tmp_path / "server.log") as server:
        for prompt in ("The weather today", "Once upon a time"):
            assert _text(server, "k3tp2", prompt) == _text(server, "k3", prompt)
