"""Talking to k3trt in Triton Inference Server with `tritonclient`: one answer over HTTP (the
`k3_unary` model), a streamed chat over gRPC (the decoupled `k3` model: reasoning and content
deltas, the last response flagged final), and JSON-schema output.

    k3trt triton-repo ENGINE_DIR --output REPO && tritonserver --model-repository REPO &   # then:
    python examples/triton_client.py --http 127.0.0.1:8000 --grpc 127.0.0.1:8001

Without --http/--grpc it builds the tiny random-weight engine, writes its repository and starts
the `tritonserver` of the nvidia-pytriton wheel on loopback (installed on first use into
~/.cache/k3trt/triton with a numpy<2 environment for the Python backend; see
k3trt/triton/launch.py). Random weights write gibberish; thinking is turned off for the JSON
call so the grammar starts at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from k3trt.builder.build import build_engine
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.triton import launch, write_model_repository

PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"]}
KINDS = {str: ("BYTES", object), bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}


def inputs(module, **values) -> list:
    """Triton input tensors, one element each (`stop` may be a list of strings; `seed` is INT64)."""
    out = []
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        kind, dtype = ("INT64", np.int64) if name == "seed" else KINDS[type(items[0])]
        arr = np.array([v.encode() if isinstance(v, str) else v for v in items], dtype=dtype)
        t = module.InferInput(name, list(arr.shape), kind)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def text(result, name: str) -> str:
    arr = result.as_numpy(name)
    return "" if arr is None else arr[0].decode()


def demo(http: str, grpc: str, model: str, tiny: bool) -> None:
    # 1. one answer over HTTP /infer: the unary front (decoupled models cannot answer /infer)
    h = httpclient.InferenceServerClient(http)
    r = h.infer(f"{model}_unary", inputs(httpclient, text_input="The capital of France is", max_tokens=16,
                                         temperature=0.0, stop=["\n\n"]))
    print("http text:", repr(text(r, "text_output")), "| finish:", text(r, "finish_reason"),
          "| tokens:", int(r.as_numpy("prompt_tokens")[0]), "+", int(r.as_numpy("completion_tokens")[0]))

    # 2. a streamed chat over gRPC: reasoning and content deltas as they are generated
    g, responses = grpcclient.InferenceServerClient(grpc), queue.Queue()
    g.start_stream(callback=lambda result, error: responses.put((result, error)))
    messages = json.dumps([{"role": "user", "content": "Say hello."}])
    g.async_stream_infer(model, inputs(grpcclient, messages=messages, max_tokens=32, temperature=0.6, seed=1,
                                       stream=True), request_id="chat-1")
    print("grpc stream: ", end="")
    while True:
        result, error = responses.get(timeout=120)
        if error is not None:
            raise error
        print(text(result, "reasoning_output") + text(result, "text_output"), end="", flush=True)
        if result.get_response().parameters["triton_final_response"].bool_param:
            print("\n  finish:", text(result, "finish_reason"), "| stats:", text(result, "stats"))
            break
    g.stop_stream()

    # 3. structured output: the answer matches the JSON schema
    extra = {"thinking": False} if tiny else {}
    r = h.infer(f"{model}_unary", inputs(httpclient, messages=json.dumps([{"role": "user", "content":
                                         "Pick a color and a digit, as JSON."}]), max_tokens=64, temperature=0.0,
                                         guided_json=json.dumps(PICK), **extra))
    print("guided_json:", json.loads(text(r, "text_output")))


@contextlib.contextmanager
def tiny_triton(workdir: Path):
    """The tiny engine in a fresh repository, served by the nvidia-pytriton wheel's tritonserver."""
    ckpt, engine = workdir / "tiny-ckpt", workdir / "tiny-engine"
    if not ckpt.exists():
        make_checkpoint("tiny", ckpt, seed=0)
    if not engine.exists():
        build_engine(ckpt, engine, dtype="fp32", capacities=[1, 2, 4], max_num_tokens=64, spec_tokens=0,
                     block_size=16)
    site, env = launch.pytriton_site(), launch.stub_env()
    write_model_repository(engine, workdir / "repo", execution_env=env, torch_threads=1, json_max_whitespace=0)
    with launch.TritonServer(workdir / "repo", site, log_path=workdir / "tritonserver.log") as server:
        print(f"tritonserver on http {server.http}, grpc {server.grpc} (log: {workdir / 'tritonserver.log'})")
        yield server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--http", default=None, help="a running server's HTTP host:port (default: start one)")
    ap.add_argument("--grpc", default=None, help="its gRPC host:port")
    ap.add_argument("--model", default="k3", help="the engine model's name in the repository")
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the tiny engine and repository")
    args = ap.parse_args()
    if args.http or args.grpc:
        if not (args.http and args.grpc):
            ap.error("give both --http and --grpc")
        demo(args.http, args.grpc, args.model, tiny=False)
        return
    with tiny_triton(args.workdir or Path(tempfile.mkdtemp(prefix="k3trt-triton-"))) as server:
        demo(server.http, server.grpc, args.model, tiny=True)


if __name__ == "__main__":
    main()
