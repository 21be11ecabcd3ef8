"""``LLM``: the Python API and the runtime loop (schedule → forward → sample → commit → emit).

    llm = LLM("engine_dir", device="cpu")                      # options: EngineOptions
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    for delta in llm.stream("Hello", SamplingParams(temperature=0.7, seed=1)): print(delta.delta_text)

    llm = LLM("engine_dir", speculative="ngram", spec_tokens=3)   # or "draft:CKPT_DIR", "mtp"
    llm = LLM("engine_dir", tp=2, dcp=2, ep=2)   # one process per rank (rank_session.py); llm.health()
    llm.generate("Reply in JSON:", SamplingParams(guided={"json_schema": schema}, max_tokens=64))

    # images (a model with a vision tower; torch engine dir, or onnx with --encoder-capacities):
    # one <|media_pad|> per image, in order
    llm.generate([{"prompt": "<|media_pad|> What is this?", "images": [pil_image_or_bytes_or_path]}])
    llm.chat([{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Hi"}]}])

Raw prompt strings are encoded with special-token strings recognised (as Hugging Face does); use
k3trt.runtime.chat.chat_ids for chat messages with untrusted text. ``LLM`` builds the engine (an
engine dir -> session, cache, scheduler, drafter) and is a thin API over its ``StepLoop``
(loop.py), which owns the step. The session comes from the engine dir's backend (``SESSIONS``):
torch (the model, eager or as static graphs: TorchSession, GraphSession), onnx (the per-capacity
graphs in onnxruntime on the CPU: OnnxSession), tensorrt and tensorrt-rtx (their engines on the
GPU: TrtSession); everything above it is the same. ``run`` is what ``k3trt run --json`` prints. Requests submitted
with ``add_request`` are driven by ``step()``; do not mix them with a ``generate``/``stream`` call
in flight (those keep only their own outputs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch

from k3trt.engine.backends import runnable_here
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.engine.engine_dir import EngineDir, EngineDirError, read_engine_dir
from k3trt.runtime.encoder_graphs import DEFAULT_CAPACITIES
from k3trt.runtime.engine import EngineSession, TorchSession
from k3trt.runtime.graphs import GraphSession, graphs_by_default
from k3trt.runtime.kv_cache import CacheManager, plan_cache
from k3trt.runtime.chat import chat_prompt
from k3trt.runtime.loop import StepLoop
from k3trt.runtime.mtp_ahead import MTPAhead
from k3trt.runtime.media import ImageIntake, ImageLimits
from k3trt.runtime.onnx_session import OnnxSession
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.runtime.rank_session import open_rank_session, parallel_config, start_ranks
from k3trt.runtime.ranks import RankFailure
from k3trt.runtime.request import FinishReason, Request, RequestOutput
from k3trt.runtime.scheduler import Scheduler, SchedulerConfig
from k3trt.runtime.spec_step import Speculator
from k3trt.runtime.speculative import Drafter, NoDrafter, make_drafter, spec_tokens_for
from k3trt.runtime.speculative.mtp import MTPDrafter
from k3trt.runtime.structured import CompiledGuide, GuidedSpec
from k3trt.runtime.tokenizer import Tokenizer
from k3trt.runtime.trt_session import TrtSession

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int], dict]      # dict: {"prompt": str | ids, "images": [...]} (media.py)
ParamsLike = Union[SamplingParams, dict, None]
CPU_CACHE_BYTES = 1 << 30
GPU_CACHE_FRACTION = 0.8      # of the memory free after loading; the rest is for activations


@dataclass(frozen=True)
class EngineOptions:
    """Run-time choices within what the engine dir was built for (None: the build's value)."""
    max_batch: int | None = None          # live requests; the verify capacities up to it are used
    max_num_tokens: int | None = None     # tokens per step
    max_model_len: int | None = None      # prompt + output per request
    block_size: int | None = None
    num_blocks: int | None = None         # overrides the memory planner
    kv_cache_memory: int | None = None    # bytes; None: 1 GiB on CPU, 80% of free GPU memory
    prefix_caching: bool = True
    kda_checkpoints: int | None = None    # KDA state checkpoints for prefix hits; None: max_batch
    verify_checksums: bool = True
    seed: int = 0                         # draws the seeds of requests that bring none
    speculative: str = "none"             # none | ngram | draft:CKPT_DIR | mtp | layerskip:N
    spec_tokens: int | None = None        # K drafts per request (1..7); None: the build's, else 3
    draft_vocab_size: int | None = None   # model drafters score only this many ids (speculative/draft_vocab.py)
    draft_vocab_counts: str | None = None  # token counts file ranking them; None: merge order
    adaptive_k: bool = True               # per-request K from its acceptance (adaptive_k.py); False: always K
    cuda_graphs: bool | None = None       # decode/verify steps as CUDA graphs; None: on CUDA in bf16/fp16
                                          # (True off CUDA: the padded static steps, uncaptured)
    tp: int | None = None                 # multi-rank layout (rank_session.py); None: the engine dir's, else 1
    dcp: int | None = None
    ep: int | None = None
    dcp_interleave: int | None = None
    rank_timeout_s: float = 300.0         # a collective that takes longer stops a multi-rank engine
    rank_init: Callable[[int], None] | None = None   # run on each worker rank after loading (importable)
    max_encoder_tokens: int | None = None # image tokens the vision encoder makes per step; None: max_num_tokens
    max_image_bytes: int = 20 << 20       # an image's encoded size
    max_image_pixels: int = 1 << 26       # an image's width x height before the resize

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "EngineOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


class LLM:
    def __init__(self, engine_dir: str | Path, device: str | torch.device = "cpu", **options: Any):
        t0 = time.perf_counter()
        opts = EngineOptions.from_kwargs(options)
        self.engine_dir = ed = read_engine_dir(engine_dir, verify_checksums=opts.verify_checksums, rank=0)
        device = torch.device(device)
        pc = parallel_config(ed, tp=opts.tp, dcp=opts.dcp, ep=opts.ep, dcp_interleave=opts.dcp_interleave)
        if pc is not None:      # rank 0 of a multi-rank engine (a torchrun worker rank never returns)
            group, model = start_ranks(ed, pc, device, timeout_s=opts.rank_timeout_s, rank_init=opts.rank_init,
                                       verify_checksums=opts.verify_checksums)
            try:
                self._setup(ed.model, ed.build, ed.capacities, ed.tokenizer_dir, group.device, opts,
                            lambda **kw: open_rank_session(group, model, **kw), model=model, dcp=pc.dcp)
            except BaseException:
                group.close()
                raise
        else:
            model = _load_torch_model(ed, device) if ed.backend == "torch" else None
            opener = SESSIONS[ed.backend]
            self._setup(ed.model, ed.build, ed.capacities, ed.tokenizer_dir, device, opts,
                        lambda **kw: opener(ed, model, **kw), model=model)
        log.info("engine ready in %.1fs: %s (%s backend)", time.perf_counter() - t0, ed.path, ed.backend)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, build: BuildConfig, capacities: Capacities,
                   tokenizer_dir: str | Path | None = None, drafter: Drafter | None = None,
                   **options: Any) -> "LLM":
        """An engine over a K3ForCausalLM already in memory, on its device and in build.dtype: for
        benchmarks at sizes no checkpoint on disk holds, and for tests. No engine dir (engine_dir is
        None); token-id prompts only unless tokenizer_dir is given. `drafter`: a Drafter instance
        used in place of the one `speculative` names (benchmarks' oracle drafters); K is
        `spec_tokens` (default 3)."""
        self = cls.__new__(cls)
        self.engine_dir = None
        device = next(model.parameters()).device
        self._setup(model.cfg, build, capacities, Path(tokenizer_dir) if tokenizer_dir else None, device,
                    EngineOptions.from_kwargs(options), lambda **kw: _torch_session(None, model, **kw), model=model,
                    drafter=drafter)
        return self

    def _setup(self, cfg, b: BuildConfig, caps: Capacities, tokenizer_dir: Path | None, device: torch.device,
               opts: EngineOptions, open_session: Callable[..., EngineSession], *,
               model: torch.nn.Module | None, drafter: Drafter | None = None, dcp: int = 1) -> None:
        """Everything above the session, which `open_session` makes (SESSIONS); `model`: the
        target of the model-running drafters (mtp, layerskip), None for engine backends;
        `drafter`: a given drafter instead of make_drafter's. `dcp`: the scheduler's blocks hold
        block_size · dcp tokens, block_size on each rank (rank_session.py)."""
        self.options = opts
        hybrid = bool(cfg.kda_layers)
        max_num_tokens = min(opts.max_num_tokens or b.max_num_tokens, b.max_num_tokens)
        self.max_model_len = min(opts.max_model_len or b.max_seq_len, b.max_seq_len)
        method = opts.speculative if drafter is None else drafter.name
        k = spec_tokens_for(method, opts.spec_tokens, built=caps.spec_tokens)
        if model is None:
            _check_graph_options(opts, b, caps, k)
        run_caps = caps.within(max_batch=opts.max_batch, max_num_tokens=max_num_tokens, spec_tokens=k)
        verify = run_caps.verify
        self.config = SchedulerConfig(max_num_tokens=max_num_tokens, capacities=run_caps,
                                      max_model_len=self.max_model_len, prefix_caching=opts.prefix_caching,
                                      hybrid=hybrid, max_encoder_tokens=opts.max_encoder_tokens or max_num_tokens)
        checkpoints = (verify[-1] if opts.kda_checkpoints is None else opts.kda_checkpoints) \
            if hybrid and opts.prefix_caching else 0
        budget = dcp * (opts.kv_cache_memory or (int(torch.cuda.mem_get_info(device)[0] * GPU_CACHE_FRACTION)
                                          if device.type == "cuda" else CPU_CACHE_BYTES))
        plan = plan_cache(cfg, budget_bytes=budget, block_size=dcp * (opts.block_size or b.block_size),
                          max_live=verify[-1], max_model_len=self.max_model_len, kv_dtype=b.kv_torch_dtype,
                          state_dtype=b.torch_dtype, num_blocks=opts.num_blocks, num_checkpoints=checkpoints,
                          max_q=k + 1 if k else 0)
        graphs = opts.cuda_graphs if opts.cuda_graphs is not None else graphs_by_default(device, b.torch_dtype)
        if graphs and device.type != "cuda" and model is not None:   # the tests check the padded static steps this way
            log.warning("cuda_graphs on %s: static padded steps without capture", device)
        self.session = open_session(cfg=cfg, plan=plan, run_caps=run_caps, built=caps, k=k, device=device,
                                    graphs=graphs, build=b, max_model_len=self.max_model_len)
        if not k:
            drafter = NoDrafter()
        elif drafter is None:
            drafter = getattr(self.session, "make_drafter", make_drafter)(
                opts.speculative, k=k, max_live=verify[-1], max_model_len=self.max_model_len, target=model,
                dtype=b.torch_dtype, device=device, block_size=plan.block_size, sample_drafts=True, graphs=graphs,
                draft_vocab_size=opts.draft_vocab_size, draft_vocab_counts=opts.draft_vocab_counts)
        if type(drafter) is MTPDrafter and graphs:     # it drafts on the device too (spec_ahead.py)
            drafter = MTPAhead(drafter)
        self.spec = Speculator(drafter, k, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
                               adaptive=opts.adaptive_k)
        self.cache = CacheManager(plan, hybrid=hybrid, prefix_caching=opts.prefix_caching)
        self.scheduler = Scheduler(self.config, self.cache)
        self.tokenizer, self.eos_ids = _load_tokenizer(tokenizer_dir)
        self.vocab_size = cfg.vocab_size
        self.images = ImageIntake.open(model, self.session, ImageLimits(
            opts.max_image_bytes, opts.max_image_pixels, self.config.max_encoder_tokens))
        self.loop = StepLoop(self.session, self.cache, self.scheduler, self.spec, tokenizer=self.tokenizer,
                             eos_ids=self.eos_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                             seed=opts.seed, images=self.images)
        log.info("runtime on %s: verify capacities %s, prefill capacities %s, max_model_len %d, speculative %s "
                 "(K=%d), CUDA graphs %s", device, list(verify), list(run_caps.prefill),
                 self.max_model_len, method, k, "on" if graphs else "off")

    # ---------------------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, params: ParamsLike = None, request_id: str | None = None) -> str:
        check = getattr(getattr(self.session, "group", None), "check", None)
        if check is not None:
            check()                         # RankFailure: a stopped multi-rank engine takes no request
        req = self.loop.new_request(prompt, params, 0, request_id)
        self.loop.submit(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.loop.requests)

    def compile_guided(self, spec: GuidedSpec) -> "Future[CompiledGuide]":
        """Compile `spec` through the engine's grammar cache, the one the step loop uses (a request
        with the same spec then starts at once); the Future raises GrammarError for a grammar
        xgrammar refuses. The one method safe to call from another thread than the loop's."""
        return self.loop.grammars.submit(spec)

    def health(self) -> dict[str, Any]:
        """{"ok": bool, "ranks": [{"rank", "alive", "exitcode"}], "error": str | None}: not ok once a
        multi-rank engine stopped (a server answers 503)."""
        health = getattr(self.session, "health", None)
        return health() if health is not None else {"ok": True, "ranks": [{"rank": 0, "alive": True,
                                                                           "exitcode": None}], "error": None}

    def close(self) -> None:
        """Stop the grammar compile threads and free what the session allocated (engine backends;
        a multi-rank engine's workers exit)."""
        self.loop.close()
        close = getattr(self.session, "close", None)
        if close is not None:
            close()

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a snapshot (with deltas) of every request that changed. A
        multi-rank engine that stops raises RankFailure here, after ending every live request with
        that error (their final snapshots come with the next step())."""
        try:
            return self.loop.step()
        except RankFailure as e:
            for req in list(self.loop.requests.values()):
                self.loop.finish(req, FinishReason.ERROR, error=str(e))
            self.cache.copies.clear()       # KDA checkpoints of a stopped engine: nothing runs them
            raise

    @property
    def counters(self) -> dict[str, Any]:
        """The loop's running counters (steps, preemptions, generated_tokens, ...); see stats()."""
        return self.loop.counters

    # ---------------------------------------------------------------------------- batch API
    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: ParamsLike | Sequence[ParamsLike] = None) -> Iterator[RequestOutput]:
        """Yield a snapshot with deltas whenever one of these requests changes; the last one of each
        has finished=True. Closing the iterator early cancels what is left."""
        reqs = self._make_requests(prompts, sampling_params)
        for r in reqs:
            self.loop.submit(r)
        pending = {r.request_id for r in reqs}
        try:
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in list(pending):
                self.loop.abort(rid, report=False)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: ParamsLike | Sequence[ParamsLike] = None) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in prompt order."""
        done = {o.index: o for o in self.stream(prompts, sampling_params) if o.finished}
        return [done[i] for i in sorted(done)]

    def chat(self, messages: Sequence[dict], sampling_params: ParamsLike = None, *,
             tools: Sequence[dict] | None = None, thinking: bool = True) -> RequestOutput:
        """One chat (OpenAI-style messages; image parts as in runtime/chat.py) to completion."""
        if self.tokenizer is None:
            raise RequestError("messages", "chat needs the engine's tokenizer (the engine dir has none)")
        p = chat_prompt(self.tokenizer, messages, tools=tools, thinking=thinking)
        return self.generate([{"prompt": p.ids, "images": p.images}], sampling_params)[0]

    def _make_requests(self, prompts, sampling_params) -> list[Request]:
        if isinstance(prompts, (str, dict)) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise RequestError("sampling_params", f"{len(sampling_params)} given for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if not prompts:
            raise RequestError("prompt", "no prompts given")
        return [self.loop.new_request(p, sp, i, None) for i, (p, sp) in enumerate(zip(prompts, params))]

    def stats(self) -> dict[str, Any]:
        """Engine counters: steps, preemptions, generated tokens, capacity hits, cache usage, and
        speculative decoding (method, K, adaptive K on, verify steps with drafts, proposed / drafted /
        accepted tokens, acceptance rate, mean accepted length, accepted-length histogram, K used: mean
        and histogram over (request, step), and the drafter's own counters under "drafter")."""
        return self.loop.stats()


def run(engine_dir: str | Path, prompt: str, **kwargs: Any) -> dict[str, Any]:
    """One prompt through a fresh engine: what `k3trt run ... --json` prints (oneshot.run has the
    keyword arguments: chat, max_tokens, temperature, seed, device, speculative, json_schema, regex,
    grammar, and engine options)."""
    from k3trt.runtime.oneshot import run as run_once  # noqa: PLC0415 (cycle: oneshot imports this module)
    return run_once(engine_dir, prompt, **kwargs)


def _load_tokenizer(tok_dir: Path | None):
    """The tokenizer and the EOS ids (the tokenizer's and generation_config.json's), if present."""
    if tok_dir is None or not any(tok_dir.glob("tokenizer*")):
        log.warning("engine dir has no tokenizer: token-id prompts only, no text or stop strings")
        return None, frozenset()
    tok = Tokenizer.from_dir(tok_dir)
    eos = {tok.eos_token_id} - {None}
    gen = tok_dir / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos |= set(e if isinstance(e, list) else [e]) - {None}
    return tok, frozenset(eos)


# ---------------------------------------------------------------------------- sessions by backend
def _load_torch_model(ed: EngineDir, device: torch.device) -> torch.nn.Module:
    # the one strict loader, imported here: it pulls in the model code and registers the plugins,
    # which the other backends and from_model do not need
    from k3trt.model.loader import load_model  # noqa: PLC0415 (heavy: model code, op registrations)
    return load_model(ed.rank_dir, dtype=ed.build.torch_dtype, device=device)[1]


def _check_graph_options(opts: EngineOptions, b: BuildConfig, caps: Capacities, k: int) -> None:
    """Engine options per-capacity graphs cannot follow (their shapes were fixed by the build)."""
    if opts.block_size not in (None, b.block_size):
        raise ValueError(f"block_size {opts.block_size}: the engine's graphs were built for blocks of "
                         f"{b.block_size} tokens")
    if k > caps.spec_tokens:
        raise ValueError(f"spec_tokens {k}: the engine's verify graphs run {caps.spec_tokens + 1} rows per request "
                         f"(built with --spec-tokens {caps.spec_tokens}); ask for at most {caps.spec_tokens} or "
                         "rebuild")
    if opts.speculative == "mtp" or opts.speculative.startswith("layerskip:"):
        raise ValueError(f"--speculative {opts.speculative} runs the model's own layers and hidden states, which "
                         "an engine's graphs do not give: use ngram or draft:DIR, or a torch engine dir")


def _torch_session(ed: EngineDir | None, model: torch.nn.Module, *, cfg, plan, run_caps: Capacities, k: int,
                   device: torch.device, graphs: bool, build: BuildConfig, max_model_len: int, **_) -> EngineSession:
    kw = dict(device=device, dtype=build.torch_dtype, kv_dtype=build.kv_torch_dtype, kv_scale=build.kv_scale,
              max_q=k + 1 if k else 0)
    if graphs:
        return GraphSession(model, cfg, plan, capacities=run_caps.verify, q_values=(1, k + 1) if k else (1,),
                            max_blocks=-(-max_model_len // plan.block_size),
                            encoder_capacities=run_caps.encoder or DEFAULT_CAPACITIES, **kw)
    return TorchSession(model, cfg, plan, **kw)


def _onnx_session(ed: EngineDir, model: None, *, cfg, plan, run_caps: Capacities, built: Capacities,
                  device: torch.device, build: BuildConfig, **_) -> EngineSession:
    if device.type != "cpu":
        raise ValueError(f"{ed.path} is an onnx engine dir, run by onnxruntime on the CPU: use device cpu")
    return OnnxSession(ed.rank_dir, cfg, plan, verify=run_caps.verify, prefill=run_caps.prefill,
                       spec_tokens=built.spec_tokens, max_seq_len=build.max_seq_len, dtype=build.torch_dtype,
                       kv_dtype=build.kv_torch_dtype, kv_scale=build.kv_scale, threads=torch.get_num_threads(),
                       encoder=built.encoder)


def _trt_session(ed: EngineDir, model: None, *, cfg, plan, run_caps: Capacities, built: Capacities,
                 device: torch.device, build: BuildConfig, **_) -> EngineSession:
    reason = runnable_here(ed.backend, ed.target)
    if reason is not None:
        raise EngineDirError(f"{ed.path} was built for the {ed.backend!r} backend (target {ed.target or '?'}), and "
                             f"this machine cannot run it: {reason}. Build one it runs: `k3trt build CHECKPOINT "
                             "--output DIR --backend torch` (or --backend onnx, on the CPU)")
    if device.type != "cuda":
        raise ValueError(f"{ed.path} holds {ed.backend} engines, which run on the GPU: use device cuda")
    return TrtSession(ed.rank_dir, cfg, plan, backend=ed.backend, verify=run_caps.verify, prefill=run_caps.prefill,
                      spec_tokens=built.spec_tokens, max_seq_len=build.max_seq_len, dtype=build.torch_dtype,
                      kv_dtype=build.kv_torch_dtype, device=str(device), target=ed.target,
                      plugin_library=ed.plugin_library_path())


# engine dir backend -> its session (keyword arguments: LLM._setup's open_session call)
SESSIONS: dict[str, Callable[..., EngineSession]] = {
    "torch": _torch_session, "onnx": _onnx_session, "tensorrt": _trt_session, "tensorrt-rtx": _trt_session}
