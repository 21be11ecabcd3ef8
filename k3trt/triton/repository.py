"""`k3trt triton-repo`: a Triton model repository that serves one k3trt engine dir.

    REPO/k3/config.pbtxt         the engine model: Python backend, decoupled (streaming), one
    REPO/k3/1/model.py           instance group; parameters name the engine dir and k3trt
    REPO/k3_unary/config.pbtxt   a front for clients that want one response (HTTP /infer, gRPC
    REPO/k3_unary/1/model.py     ModelInfer): Triton refuses those calls on decoupled models, so
                                 it forwards to k3 (BLS) and answers once; it loads no engine

A multi-rank engine dir (config.json's parallel block over more than one rank) is served by one
instance that owns all its ranks: its LLM starts the other ranks' processes (GPUs 0..N-1 of the
node), so the group is ``count: 1`` of ``KIND_MODEL`` (the model places itself), or ``KIND_CPU``
on the CPU; more instances or a GPU list are refused.

Both model.py files are the same small file (triton_model.py): it puts `k3trt_python_path` on
sys.path (the Python backend's stub ignores PYTHONPATH) and hands over to k3trt.triton. The
engine dir is recorded as an absolute path. `execution_env` becomes the Python backend's
EXECUTION_ENV_PATH: a Python environment (a venv works) whose `python3` the stub process runs
with; see launch.py for why the one of pytriton 0.7.0's server needs numpy < 2.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Sequence

from k3trt.triton.schema import INPUTS, OUTPUTS, Tensor

log = logging.getLogger(__name__)

ROLE_KEY = "k3trt_role"          # marks a model dir as ours (rewritable); values: engine | unary
DEVICES = ("auto", "cpu", "cuda")


def default_python_path() -> str:
    """The directory holding this k3trt package when it is a source checkout (recorded, so the stub
    imports the same code); "" for an installed package, which the stub's environment provides
    (putting a whole site-packages first on the stub's sys.path could shadow that environment's own)."""
    root = Path(__file__).resolve().parents[2]
    return "" if root.name in ("site-packages", "dist-packages") else str(root)


def write_model_repository(engine_dir: str | Path, output: str | Path, *, instances: int = 1,
                           max_batch: int | None = None, model_name: str = "k3", device: str = "auto",
                           gpus: Sequence[int] | None = None, unary: bool = True,
                           python_path: str | None = None, execution_env: str | Path | None = None,
                           engine_options: dict[str, Any] | None = None, max_queue: int = 256,
                           torch_threads: int = 0, json_max_whitespace: int | None = None,
                           max_prompt_chars: int | None = None) -> Path:
    """Write (or rewrite) the models for `engine_dir` into the repository `output`; returns the
    engine model's directory. `instances` engine copies per GPU (device auto/cuda) or in all
    (cpu); `max_batch` live requests per instance (default: the build's); `python_path=""`
    relies on the stub's environment to provide k3trt; `engine_options` go to LLM(...) (e.g.
    speculative="ngram"); `json_max_whitespace` caps whitespace runs in guided JSON (as
    `k3trt serve`); `max_prompt_chars` refuses a request whose prompt text (messages, tools,
    text_input) is longer, before it is tokenized (as `k3trt serve`; default
    DEFAULT_MAX_PROMPT_CHARS); `torch_threads` > 0 sets torch's CPU threads per instance."""
    engine = Path(engine_dir).resolve()
    cfg_file = engine / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{engine_dir}: not a k3trt engine dir (no config.json); build one with `k3trt build`")
    if instances < 1 or (max_batch is not None and max_batch < 1) or max_queue < 0 or \
            (max_prompt_chars is not None and max_prompt_chars < 1):
        raise ValueError(f"instances, max_batch and max_prompt_chars must be >= 1 and max_queue >= 0, got "
                         f"{instances}, {max_batch}, {max_prompt_chars}, {max_queue}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if gpus is not None and device == "cpu":
        raise ValueError("gpus needs device auto or cuda")
    world = engine_world_size(cfg_file)
    if world > 1 and (instances != 1 or gpus is not None):
        raise ValueError(f"{engine_dir} runs on {world} ranks, which one instance owns (it starts the ranks' "
                         f"processes on GPUs 0..{world - 1}): use one instance and no GPU list "
                         f"(got instances={instances}, gpus={gpus})")
    options = dict(engine_options or {})
    if max_batch is not None:
        options["max_batch"] = max_batch
    common = {"k3trt_python_path": default_python_path() if python_path is None else python_path}
    if execution_env is not None:
        common["EXECUTION_ENV_PATH"] = str(Path(execution_env).resolve())
    repo = Path(output)
    engine_params = {ROLE_KEY: "engine", "engine_dir": str(engine), "engine_options": json.dumps(options),
                     "max_queue": str(max_queue), "torch_threads": str(torch_threads),
                     "json_max_whitespace": "" if json_max_whitespace is None else str(json_max_whitespace),
                     "max_prompt_chars": "" if max_prompt_chars is None else str(max_prompt_chars), **common}
    group = _ranks_group(device) if world > 1 else _instance_group(instances, device, gpus)
    _write_model(repo, model_name, engine_params, group, decoupled=True)
    if unary:
        _write_model(repo, f"{model_name}_unary", {ROLE_KEY: "unary", "target_model": model_name, **common},
                     "instance_group [ { count: 1 kind: KIND_CPU } ]", decoupled=False)
    log.info("wrote Triton model %r%s for %s into %s", model_name, f" (+ {model_name}_unary)" if unary else "",
             engine, repo)
    return repo / model_name


def engine_world_size(cfg_file: Path) -> int:
    """The ranks an engine dir runs on, from its config.json (read_engine_dir checks it at load)."""
    try:
        par = json.loads(cfg_file.read_text()).get("parallel") or {}
        return max(int(par.get(k, 1)) for k in ("tp", "dcp", "ep"))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{cfg_file}: unreadable engine config ({e}); rebuild the engine dir") from None


def _ranks_group(device: str) -> str:
    kind = "KIND_CPU" if device == "cpu" else "KIND_MODEL"
    return f"instance_group [ {{ count: 1 kind: {kind} }} ]"


def _instance_group(count: int, device: str, gpus: Sequence[int] | None) -> str:
    # no kind: Triton puts `count` instances on every visible GPU, or on the CPU when it sees none
    kind = {"auto": "", "cpu": " kind: KIND_CPU", "cuda": " kind: KIND_GPU"}[device]
    where = f" gpus: [ {', '.join(map(str, gpus))} ]" if gpus else ""
    return f"instance_group [ {{ count: {count}{kind}{where} }} ]"


def _write_model(repo: Path, name: str, params: dict[str, str], group: str, *, decoupled: bool) -> None:
    mdir = repo / name
    if mdir.exists():
        old = mdir / "config.pbtxt"
        if not (old.is_file() and ROLE_KEY in old.read_text()):
            raise FileExistsError(f"{mdir} exists and is not a k3trt model; pick another --output or model name")
        shutil.rmtree(mdir)
    (mdir / "1").mkdir(parents=True)
    (mdir / "config.pbtxt").write_text(config_text(name, params, group, decoupled=decoupled))
    shutil.copyfile(Path(__file__).with_name("triton_model.py"), mdir / "1" / "model.py")


def config_text(name: str, params: dict[str, str], group: str, *, decoupled: bool) -> str:
    """config.pbtxt in protobuf text format (tests parse it with tritonclient's model_config_pb2)."""
    lines = [f"name: {_q(name)}", 'backend: "python"', "max_batch_size: 0",
             f"model_transaction_policy {{ decoupled: {str(decoupled).lower()} }}",
             "input [", _tensors(INPUTS, optional=True), "]", "output [", _tensors(OUTPUTS), "]", group]
    lines += [f"parameters: {{ key: {_q(k)} value: {{ string_value: {_q(v)} }} }}" for k, v in params.items()]
    return "\n".join(lines) + "\n"


def _tensors(tensors: tuple[Tensor, ...], optional: bool = False) -> str:
    opt = " optional: true" if optional else ""
    return ",\n".join(f"  {{ name: {_q(t.name)} data_type: TYPE_{t.dtype} dims: [ {', '.join(map(str, t.dims))} ]"
                      f"{opt} }}" for t in tensors)


def _q(text: str) -> str:
    """A protobuf text-format string literal (octal escapes for anything not printable ASCII)."""
    out = []
    for b in text.encode():
        c = chr(b)
        out.append("\\" + c if c in '"\\' else c if 32 <= b < 127 else f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def triton_repo_main(engine_dir: str | Path, output: str | Path, instances: int = 1, max_batch: int | None = None,
                     **options: Any) -> Path:
    """What `k3trt triton-repo ENGINE_DIR --output REPO [--instances N] [--max-batch N]` runs; `options`:
    the other write_model_repository keywords (model_name, device, execution_env, engine_options, ...)."""
    path = write_model_repository(engine_dir, output, instances=instances, max_batch=max_batch, **options)
    repo = path.parent.resolve()
    log.info("wrote %s: model %r (decoupled: gRPC streaming, HTTP generate_stream) and %r (one response: "
             "HTTP /infer, gRPC ModelInfer); start it with: tritonserver --model-repository %s",
             repo, path.name, path.name + "_unary", repo)
    return path
