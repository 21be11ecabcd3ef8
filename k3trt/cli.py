"""The ``k3trt`` command line: one click group, each command a thin layer over the Python API."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import click

from k3trt import __version__
from k3trt.engine.build_config import DTYPES, KV_DTYPES
from k3trt.engine.capacities import CapacityError, parse_capacity_list
from k3trt.model.presets import PRESETS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3trt")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """Compile and serve Kimi K3."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


@main.command("make-checkpoint")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--output", "-o", type=click.Path(file_okay=False), required=True, help="new checkpoint directory")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quant", type=click.Choice(["none", "fp8", "mxfp4"]), default="none", show_default=True,
              help="fp8: block-scaled e4m3 projections; mxfp4: routed experts as K3 ships them")
@click.option("--device", default="cpu", show_default=True, help="where to generate the random weights")
def make_checkpoint_cmd(preset: str, output: str, seed: int, quant: str, device: str) -> None:
    """Write a random-weight Kimi K3 checkpoint in the real Hugging Face layout."""
    from k3trt.model.make_checkpoint import make_checkpoint  # noqa: PLC0415 (heavy: torch, model code)
    try:
        path = make_checkpoint(preset, output, seed=seed, quant=quant, device=device)
    except (FileExistsError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path))


def _capacities_of(kind: str) -> Callable:
    """A click callback parsing a comma-separated list of `kind` capacities."""
    def parse(ctx, param, value: str | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        try:
            return parse_capacity_list(value, kind)
        except CapacityError as e:
            raise click.BadParameter(str(e)) from None
    return parse


_capacity_list, _encoder_capacity_list = _capacities_of("verify"), _capacities_of("encoder")


@main.command("build")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), required=True, help="engine directory to write")
@click.option("--backend", type=click.Choice(["auto", "torch", "onnx", "tensorrt", "tensorrt-rtx"]), default="auto",
              show_default=True, help="onnx: the engine graphs run by onnxruntime on the CPU (fp32)")
@click.option("--capacities", callback=_capacity_list,
              help="verify batch capacities, e.g. 1,2,4,8 (default: powers of two)")
@click.option("--max-num-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="largest prefill token capacity")
@click.option("--spec-tokens", type=click.IntRange(0, 7), default=3, show_default=True,
              help="K: drafts verified per step (each verify row group is K+1 rows)")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bf16", show_default=True)
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default="auto",
              show_default=True, help="MLA cache dtype (auto: the model dtype); fp8 halves the "
              "cache's memory and is the faster path from batch 32 at 12 local heads (on the H200, "
              "1.5-1.6x the bf16 kernel's speed from 8K context; README)")
@click.option("--block-size", type=click.IntRange(min=16), default=64, show_default=True)
@click.option("--target", default=None, help="GPU target for engine backends, e.g. sm90, sm120")
@click.option("--check-onnx", is_flag=True, help="run every exported graph in onnxruntime against the torch model (fp32)")
@click.option("--force", is_flag=True,
              help="rebuild every capacity even if OUTPUT holds engines built from the same inputs")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="worker processes building capacities in parallel (engine backends; each loads the model)")
@click.option("--device-memory", "device_memory", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GiB of memory on each target device: the build stops first if the weights cannot fit "
              "(default: the visible GPU's memory; no GPU, no check)")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="tensor-parallel ranks: heads, MLP widths and lm_head split (torch backend: one rank dir each)")
@click.option("--dcp", type=click.IntRange(min=1), default=1, show_default=True,
              help="decode-context-parallel ranks: the MLA cache split by token")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
              help="expert-parallel ranks: routed experts in contiguous ranges")
@click.option("--dcp-interleave", type=click.IntRange(min=1), default=1, show_default=True,
              help="consecutive tokens on one DCP rank before the next")
@click.option("--rtx-lowering", type=click.Choice(["plugin", "native"]), default="plugin", show_default=True,
              help="plugin: k3trt ops as layers of the k3trt plugin library (k3trt build-plugins); native: "
              "TensorRT-RTX's fallback without the library, the ops lowered to standard ONNX (dense MLA and "
              "experts, KDA unrolled: prefill capacities <= 64)")
@click.option("--encoder-capacities", callback=_encoder_capacity_list,
              help="vision encoder patch capacities, e.g. 1024,4096 (torch: one CUDA graph each; onnx: one graph "
                   "each, and prefill graphs that take image embeddings)")
def build_cmd(checkpoint, output, backend, capacities, max_num_tokens, spec_tokens, dtype, kv_dtype,
              block_size, target, check_onnx, force, workers, device_memory, tp, dcp, ep, dcp_interleave,
              rtx_lowering, encoder_capacities) -> None:
    """Compile CHECKPOINT into an engine directory.

    OUTPUT may be an existing engine directory: it is replaced when the new one is complete, and
    capacities built from the same inputs (checkpoint, code, options, backend and target) are
    reused rather than rebuilt, unless --force. With --tp/--dcp/--ep (torch backend) the engine
    holds one rank{r}/ per rank of max(tp, dcp, ep), each with only that rank's slices."""
    from k3trt.builder.build import build_engine  # noqa: PLC0415 (heavy: torch, model code)
    from k3trt.parallel.config import ParallelConfig  # noqa: PLC0415 (heavy: torch)
    try:
        path = build_engine(checkpoint, output, backend=backend, capacities=capacities,
                            max_num_tokens=max_num_tokens, spec_tokens=spec_tokens, kv_dtype=kv_dtype,
                            dtype=dtype, block_size=block_size, target=target, check_onnx=check_onnx,
                            force=force, workers=workers,
                            parallel=ParallelConfig(tp=tp, dcp=dcp, ep=ep, dcp_interleave=dcp_interleave),
                            device_memory_gb=device_memory, echo=click.echo, rtx_lowering=rtx_lowering,
                            encoder_capacities=encoder_capacities)
    except (ValueError, FileExistsError, NotImplementedError, OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path))


@main.command("build-plugins")
@click.option("--arch", default="sm90a,sm120", show_default=True,
              help="GPU architectures, comma-separated (engine targets: sm90 engines need sm90a)")
@click.option("--force", is_flag=True, help="rebuild even when the cache holds the library")
def build_plugins_cmd(arch: str, force: bool) -> None:
    """Build the k3trt TensorRT plugin library (cached by content) and print its path."""
    from k3trt.trt_plugin.build import PluginBuildError, build_library  # noqa: PLC0415 (heavy: nvcc tooling)
    try:
        path = build_library(tuple(a.strip() for a in arch.split(",") if a.strip()), force=force)
    except (PluginBuildError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path))


def rank_options(f):
    """--tp/--dcp/--ep (EngineDir.layout: a split engine dir's must match, an unsplit one runs what
    they ask for) and --rank-timeout."""
    f = click.option("--rank-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="seconds a collective may take before a multi-rank engine stops with an error "
                     "(default: the runtime's, 300)")(f)
    for name, what in (("ep", "expert"), ("dcp", "decode-context"), ("tp", "tensor")):
        f = click.option(f"--{name}", type=click.IntRange(min=1), default=None,
                         help=f"{what}-parallel ranks: a split engine dir's own (default: read from it; others "
                         "are refused), or any layout for an unsplit one (its checkpoint is sliced at load)")(f)
    return f


def draft_options(f):
    """--draft-vocab, --draft-vocab-counts and --adaptive-k/--fixed-k: how model drafters draft."""
    f = click.option("--adaptive-k/--fixed-k", default=True, show_default=True,
                     help="per-request K from its recent acceptance, up to --spec-tokens")(f)
    f = click.option("--draft-vocab-counts", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="token counts ranking the draft vocabulary (JSON list/object or one count per line; "
                     "default: the tokenizer's merge order)")(f)
    return click.option("--draft-vocab", "draft_vocab", type=click.IntRange(min=1), default=None,
                        help="model drafters (mtp, draft:DIR, layerskip:N) score only the N most frequent ids")(f)


def _draft_engine_options(draft_vocab, draft_vocab_counts, adaptive_k) -> dict:
    """The engine options draft_options' flags ask for (those given; the runtime checks them)."""
    opts = {k: v for k, v in (("draft_vocab_size", draft_vocab), ("draft_vocab_counts", draft_vocab_counts))
            if v is not None}
    return opts if adaptive_k else {**opts, "adaptive_k": False}


def _rank_engine_options(engine_dir, tp, dcp, ep, rank_timeout) -> dict:
    """Engine options for the rank layout ENGINE_DIR runs with (EngineDir.layout: a split engine
    dir's own, which --tp/--dcp/--ep must match; an unsplit one's from them), after checking that
    a torchrun world has its size."""
    from k3trt.engine.engine_dir import read_engine_dir  # noqa: PLC0415 (heavy: torch)
    ed = read_engine_dir(engine_dir, verify_checksums=False)
    pc = ed.layout(tp=tp, dcp=dcp, ep=ep)
    world = os.environ.get("WORLD_SIZE")
    if world is not None and "RANK" in os.environ and int(world) != pc.world_size:
        raise ValueError(f"torchrun started {world} processes; {engine_dir} runs on {pc.world_size} "
                         f"(tp={pc.tp} dcp={pc.dcp} ep={pc.ep}): start torchrun with --nnodes x --nproc-per-node = "
                         f"{pc.world_size}")
    opts = {k: v for k, v in dict(tp=tp, dcp=dcp, ep=ep).items() if v is not None and ed.world_size == 1}
    if rank_timeout is None:
        return opts
    if pc.world_size == 1:
        logging.getLogger(__name__).info("--rank-timeout: %s runs on one rank; ignored", engine_dir)
        return opts
    return {**opts, "rank_timeout_s": rank_timeout}


def _torchrun_worker(engine_dir, device: str, options: dict) -> bool:
    """Under torchrun every process runs the same command: rank 0 goes on (it serves, or prints),
    ranks > 0 only join the engine. Their LLM runs rank 0's steps on their shards and ends the
    process when rank 0 closes the engine; True when this process was such a rank."""
    if int(os.environ.get("RANK", "0")) == 0 or "WORLD_SIZE" not in os.environ:
        return False
    from k3trt.runtime.llm import LLM  # noqa: PLC0415 (heavy: torch, model code)
    llm = LLM(engine_dir, device=device, **options)      # a worker rank returns only by SystemExit
    llm.close()
    raise ValueError(f"rank {os.environ['RANK']} of a torchrun world loaded {engine_dir} as a whole engine: "
                     "this k3trt's runtime does not join a torchrun world (multi-rank runtime missing)")


@main.command("run")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "-p", required=True)
@click.option("--chat", is_flag=True, help="wrap the prompt as a user message in the K3 chat template")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--speculative", default="none", show_default=True, help="none | ngram | draft:DIR | mtp | layerskip:N")
@click.option("--spec-tokens", type=click.IntRange(1, 7), default=None, help="K drafts per step (default: the engine's)")
@draft_options
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="constrain the output to this JSON schema (a file)")
@click.option("--regex", default=None, help="constrain the output to this regular expression")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="constrain the output to this EBNF grammar (a file; root rule `root`)")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="an image before the prompt text (with --chat; repeatable, in order)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: text, token ids, stats")
@rank_options
def run_cmd(engine_dir, prompt, chat, max_tokens, temperature, seed, speculative, spec_tokens, draft_vocab,
            draft_vocab_counts, adaptive_k, json_schema, regex, grammar, device, images, as_json, tp,
            dcp, ep, rank_timeout) -> None:
    """Generate from ENGINE_DIR (a multi-rank engine: its ranks run in processes of their own)."""
    from k3trt.runtime.llm import run  # noqa: PLC0415 (heavy: torch, model code)
    try:
        ranks = _rank_engine_options(engine_dir, tp, dcp, ep, rank_timeout)
        if _torchrun_worker(engine_dir, device, ranks):
            return
        out = run(engine_dir, prompt, chat=chat, max_tokens=max_tokens, temperature=temperature, seed=seed,
                  device=device, speculative=speculative, spec_tokens=spec_tokens, json_schema=json_schema,
                  regex=regex, grammar=grammar, images=list(images),
                  **_draft_engine_options(draft_vocab, draft_vocab_counts, adaptive_k), **ranks)
    except (ValueError, NotImplementedError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(out) if as_json else out["text"])


@main.command("serve")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None,
              help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (/health stays open)")
@click.option("--model-name", default=None, help="served model id (default: the engine dir's name)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="choices queued beyond the live batch before 429")
@click.option("--max-prompt-chars", type=click.IntRange(min=1), default=None,
              help="characters of prompt text (messages, tools, prompt) past which a request is refused "
                   "before it is tokenized (default 1,000,000); the body limit is 12 bytes a character + 1 MiB")
@click.option("--max-batch", type=click.IntRange(min=1), default=None)
@click.option("--speculative", default="none", show_default=True,
              help="none | ngram | draft:DIR | mtp | layerskip:N (a request opts out with \"speculative\": false)")
@click.option("--spec-tokens", type=click.IntRange(1, 7), default=None, help="K drafts per step (default: the engine's)")
@draft_options
@click.option("--allowed-media-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="image_url file:// paths are read only under this directory (default: none; data: URLs always)")
@click.option("--max-image-bytes", type=click.IntRange(min=1), default=None,
              help="an image's size limit in bytes (default 20 MiB)")
@rank_options
def serve_cmd(engine_dir, host, port, api_key, model_name, device, max_queue, max_prompt_chars, max_batch,
              speculative, spec_tokens, draft_vocab, draft_vocab_counts, adaptive_k, allowed_media_dir,
              max_image_bytes, tp, dcp, ep, rank_timeout) -> None:
    """Serve ENGINE_DIR over an OpenAI-compatible HTTP API. A multi-rank engine's ranks run in
    processes of their own on this node; under torchrun rank 0 serves and the others are workers."""
    from k3trt.serve import serve_main  # noqa: PLC0415 (optional: serve extras)
    opts = {"max_batch": max_batch} if max_batch else {}
    if speculative != "none":
        opts["speculative"] = speculative
    if spec_tokens is not None:
        opts["spec_tokens"] = spec_tokens
    opts.update(_draft_engine_options(draft_vocab, draft_vocab_counts, adaptive_k))
    if max_image_bytes is not None:
        opts["max_image_bytes"] = max_image_bytes
    try:
        opts.update(_rank_engine_options(engine_dir, tp, dcp, ep, rank_timeout))
        if _torchrun_worker(engine_dir, device, opts):
            return
        serve_main(engine_dir, host, port, api_key, model_name=model_name, device=device,
                   max_queue=max_queue, engine_options=opts, allowed_media_dir=allowed_media_dir,
                   **({} if max_prompt_chars is None else {"max_prompt_chars": max_prompt_chars}))
    except (ValueError, NotImplementedError) as e:     # engine options the engine dir cannot run
        raise click.ClickException(str(e)) from None


@main.command("triton-repo")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), required=True, help="model repository to write")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="model instances (each its own process with its own engine and cache)")
@click.option("--max-batch", type=click.IntRange(min=1), default=None, help="live requests per instance")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--python-env", "execution_env", type=click.Path(file_okay=False), default=None,
              help="environment for Triton's Python stub (EXECUTION_ENV_PATH); see README")
@click.option("--max-prompt-chars", type=click.IntRange(min=1), default=None,
              help="characters of prompt text (messages, tools, text_input) past which a request is refused "
                   "before it is tokenized (default 1,000,000)")
@click.option("--speculative", default=None, help="none | ngram | draft:DIR | mtp | layerskip:N")
@rank_options
def triton_repo_cmd(engine_dir, output, instances, max_batch, device, execution_env, max_prompt_chars,
                    speculative, tp, dcp, ep, rank_timeout) -> None:
    """Write a Triton Inference Server model repository serving ENGINE_DIR (a multi-rank engine:
    one instance owning all its ranks)."""
    from k3trt.engine.engine_dir import read_engine_dir  # noqa: PLC0415 (heavy: torch)
    from k3trt.triton import triton_repo_main  # noqa: PLC0415 (optional: serve extras)
    try:
        opts = _triton_engine_options(engine_dir, speculative, tp, dcp, ep, rank_timeout)
        backend = read_engine_dir(engine_dir, verify_checksums=False).backend
        device = _engine_device(backend, device)
        path = triton_repo_main(engine_dir, output, instances, max_batch, device=device,
                                execution_env=execution_env, max_prompt_chars=max_prompt_chars, **opts)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(path.parent))


@main.command("triton-serve")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="address of all three endpoints")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--repo", type=click.Path(file_okay=False), default=None,
              help="write the model repository here (default: a temporary directory)")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=None, help="live requests per instance")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-prompt-chars", type=click.IntRange(min=1), default=None,
              help="characters of prompt text (messages, tools, text_input) past which a request is refused "
                   "before it is tokenized (default 1,000,000)")
@click.option("--speculative", default=None, help="none | ngram | draft:DIR | mtp | layerskip:N")
@rank_options
def triton_serve_cmd(engine_dir, host, http_port, grpc_port, metrics_port, repo, instances, max_batch, device,
                     max_prompt_chars, speculative, tp, dcp, ep, rank_timeout) -> None:
    """Serve ENGINE_DIR with Triton Inference Server until Ctrl-C. The first run installs the
    tritonserver of nvidia-pytriton and a numpy<2 environment for its Python stub (cached under
    ~/.cache/k3trt/triton; the k3trt environment is not touched)."""
    from k3trt.engine.engine_dir import read_engine_dir  # noqa: PLC0415 (heavy: torch)
    from k3trt.triton.serve import triton_serve_main  # noqa: PLC0415 (optional: serve extras)
    try:
        opts = _triton_engine_options(engine_dir, speculative, tp, dcp, ep, rank_timeout)
        device = _engine_device(read_engine_dir(engine_dir, verify_checksums=False).backend, device)
        code = triton_serve_main(engine_dir, repo=repo, host=host, http_port=http_port, grpc_port=grpc_port,
                                 metrics_port=metrics_port, instances=instances, max_batch=max_batch,
                                 device=device, max_prompt_chars=max_prompt_chars, **opts)
    except (ValueError, OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)


def _triton_engine_options(engine_dir, speculative, tp, dcp, ep, rank_timeout) -> dict:
    engine = {"speculative": speculative} if speculative else {}
    engine.update(_rank_engine_options(engine_dir, tp, dcp, ep, rank_timeout))
    return {"engine_options": engine} if engine else {}


# where each engine dir backend runs: the Triton instances' kind (auto: the first)
ENGINE_DEVICES = {"torch": ("auto", "cpu", "cuda"), "onnx": ("cpu",), "tensorrt": ("cuda",), "tensorrt-rtx": ("cuda",)}


def _engine_device(backend: str, device: str) -> str:
    allowed = ENGINE_DEVICES[backend]
    if device == "auto":
        return allowed[0]
    if device not in allowed:
        raise ValueError(f"a {backend} engine dir runs on {' or '.join(allowed)}, not --device {device}")
    return device


if __name__ == "__main__":
    main()
