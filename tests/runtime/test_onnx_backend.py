"""The onnx engine backend end to end: `k3trt build --backend onnx` writes the per-capacity graphs the
TensorRT backends build from, and `k3trt run`, the Python API and the server generate through
them (onnxruntime on the CPU, k3trt nodes as custom ops) exactly what the torch backend
generates: greedy, with speculation (K=3: every verify row through the verify graphs, padded
requests and rows, KDA rollback of rejected drafts), with a JSON schema, and with images (the
encoder graphs of --encoder-capacities, image embeddings into the prefill graphs).

Drafts come from a draft checkpoint (draft:DIR): the graphs give logits only, so MTP, which
runs on the target's hidden states, needs a torch engine dir; n-gram drafts rarely occur on a
random-weight model. The tiny checkpoint drafting for itself has every draft accepted; another
seed's has them rejected."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_extensions")
pytest.importorskip("onnxscript")

from click.testing import CliRunner  # noqa: E402

from k3trt.builder.build import build_engine  # noqa: E402
from k3trt.cli import main as cli  # noqa: E402
from k3trt.engine.engine_dir import read_engine_dir  # noqa: E402
from k3trt.model.make_checkpoint import make_checkpoint  # noqa: E402
from k3trt.runtime.llm import LLM  # noqa: E402
from k3trt.runtime.params import RequestError, SamplingParams  # noqa: E402
from k3trt.serve import ServeConfig, ServerThread  # noqa: E402
from runtime_utils import assert_released, one_thread, png  # noqa: E402

# two verify capacities (B=1, 2) of K+1 = 4 rows; prefill 1, 2, 4, 8: six graphs; encoder 16, 64 patches
BUILD = ["--dtype", "fp32", "--capacities", "1,2", "--max-num-tokens", "8", "--spec-tokens", "3",
         "--block-size", "16", "--encoder-capacities", "16,64"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PROMPT = "the cat sat on the mat, the cat sat on the mat, the cat"


@pytest.fixture(scope="module")
def engines(tiny_ckpt, tmp_path_factory):
    """(onnx engine dir, torch engine dir) built with the same options; the onnx build's seconds."""
    root = tmp_path_factory.mktemp("onnx")
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["build", str(tiny_ckpt), "-o", str(root / "onnx"), "--backend", "onnx", *BUILD])
    seconds = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    torch_dir = build_engine(tiny_ckpt, root / "torch", backend="torch", dtype="fp32", capacities=[1, 2],
                             max_num_tokens=8, spec_tokens=3, block_size=16)
    print(f"onnx build of the tiny checkpoint (6 step graphs, 2 encoder graphs): {seconds:.1f}s")
    return root / "onnx", torch_dir, seconds


def test_the_build_writes_the_engine_graphs(engines):
    ed = read_engine_dir(engines[0])
    assert ed.backend == "onnx" and ed.target is None
    names = {f"rank0/{n}.onnx" for n in ("verify_b1", "verify_b2", "prefill_t1", "prefill_t2", "prefill_t4",
                                          "prefill_t8", "encoder_p16", "encoder_p64")}
    assert names | {"rank0/weights.bin"} <= set(ed.files)
    assert not [f for f in ed.files if f.endswith(".engine")]


def test_the_build_refuses_16_bit_graphs(tiny_ckpt, tmp_path):
    r = CliRunner().invoke(cli, ["build", str(tiny_ckpt), "-o", str(tmp_path / "e"), "--backend", "onnx",
                                 "--dtype", "bf16"])
    assert r.exit_code == 1 and "--dtype fp32" in r.output, r.output
    assert not (tmp_path / "e").exists()


def _run(engine_dir, *args):
    r = CliRunner().invoke(cli, ["run", str(engine_dir), "-p", PROMPT, "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


@pytest.mark.parametrize("spec, schema", [("draft", False), ("draft", True), ("ngram", True)],
                         ids=["draft", "draft-json-schema", "ngram-json-schema"])
def test_k3trt_run_equals_the_torch_backend(engines, tiny_ckpt, spec, schema, tmp_path):
    onnx_dir, torch_dir, _ = engines
    method = f"draft:{tiny_ckpt}" if spec == "draft" else spec
    args = ["--max-tokens", "12", "--speculative", method, "--spec-tokens", "3"]
    if schema:
        (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
        args += ["--json-schema", str(tmp_path / "schema.json")]
    with one_thread():
        want, got = _run(torch_dir, *args), _run(onnx_dir, *args)
    assert got["stats"]["backend"] == "onnx" and want["stats"]["backend"] == "torch"
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert got["stats"]["speculative"] == want["stats"]["speculative"]
    if schema:                        # the grammar cuts the drafts it refuses; 12 tokens: a prefix
        assert got["text"].startswith('{"a"'), got["text"]
    else:                             # K+1 rows verified through the graphs, drafts accepted
        assert got["stats"]["speculative"]["accepted_tokens"] > 0


def test_the_python_api_batches_equal_the_torch_backend(engines, tmp_path):
    """Three requests of different lengths at max_batch 2, drafts from another seed's checkpoint
    (rejected: KDA rollback every step): verify at B=1 and B=2 with padded requests and rows,
    prefill split over the capacities, queueing."""

    onnx_dir, torch_dir, _ = engines
    draft = make_checkpoint("tiny", tmp_path / "draft", seed=1)
    prompts = [PROMPT, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(100, 121))]
    outs, stats = {}, {}
    with one_thread():
        for name, d in (("torch", torch_dir), ("onnx", onnx_dir)):
            llm = LLM(d, speculative=f"draft:{draft}", spec_tokens=3, verify_checksums=False)
            outs[name] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10))]
            stats[name] = llm.stats()
            assert_released(llm)
            llm.close()
    assert outs["onnx"] == outs["torch"]
    assert stats["onnx"]["capacity_hits"] == stats["torch"]["capacity_hits"]
    assert set(stats["onnx"]["capacity_hits"]["verify"]) == {1, 2}
    assert stats["onnx"]["speculative"]["drafted_tokens"] > stats["onnx"]["speculative"]["accepted_tokens"]


def test_engine_backends_refuse_what_their_graphs_cannot_run(engines):
    onnx_dir = engines[0]
    with pytest.raises(ValueError, match="at most 3"):
        LLM(onnx_dir, speculative="ngram", spec_tokens=4, verify_checksums=False)
    with pytest.raises(ValueError, match="ngram or draft:DIR"):
        LLM(onnx_dir, speculative="mtp", verify_checksums=False)
    with pytest.raises(ValueError, match="blocks of 16"):
        LLM(onnx_dir, block_size=32, verify_checksums=False)
    llm = LLM(onnx_dir, verify_checksums=False, max_encoder_tokens=32)   # an image past the largest encoder graph
    with pytest.raises(RequestError, match="largest encoder graph holds 64") as e:
        llm.generate({"prompt": "<|media_pad|> what is this?", "images": [png(1, 140, 112)]})
    assert e.value.field == "images"
    assert len(llm.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_image_prompts_equal_the_torch_backend(engines):
    """Two requests, three images (16 + 24 + 16 patches: one encoder call pads to 64, the next image
    runs in a second call), placeholders across prefill slices."""
    onnx_dir, torch_dir, _ = engines
    prompts = [{"prompt": "<|media_pad|> and <|media_pad|>: which is brighter?", "images": [png(1), png(2, 84, 56)]},
               {"prompt": "Describe <|media_pad|> briefly.", "images": [png(3)]}]
    outs = {}
    with one_thread():
        for name, d in (("torch", torch_dir), ("onnx", onnx_dir)):
            llm = LLM(d, verify_checksums=False, max_encoder_tokens=16)
            outs[name] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
            assert_released(llm)
            llm.close()
    assert outs["onnx"] == outs["torch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_serves_an_onnx_engine_dir(engines):
    openai = pytest.importorskip("openai")

    onnx_dir, torch_dir, _ = engines
    with one_thread():
        want = LLM(torch_dir, verify_checksums=False).generate(PROMPT, SamplingParams(max_tokens=8))[0].text
        cfg = ServeConfig(onnx_dir, port=_free_port(), model_name="tiny", engine_options={"verify_checksums": False})
        with ServerThread(cfg) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == want


def test_triton_repo_takes_the_onnx_dir_on_the_cpu(engines, tmp_path):
    onnx_dir = engines[0]
    r = CliRunner().invoke(cli, ["triton-repo", str(onnx_dir), "-o", str(tmp_path / "repo")])
    assert r.exit_code == 0, r.output
    assert "KIND_CPU" in (tmp_path / "repo" / "k3" / "config.pbtxt").read_text()
    r = CliRunner().invoke(cli, ["triton-repo", str(onnx_dir), "-o", str(tmp_path / "gpu"), "--device", "cuda"])
    assert r.exit_code == 1 and "runs on cpu" in r.output, r.output
