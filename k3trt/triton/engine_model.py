"""The engine model: the k3trt runtime inside a Triton Python-backend instance (decoupled).

One instance = one stub process = one LLM. The server's EngineLoop owns the LLM on its own
thread; an asyncio loop on a second thread serves the requests. `execute` only reads each
request's tensors and hands it to that loop, so it returns at once and the instance keeps taking
requests while others generate (continuous batching happens in the runtime, not in Triton).
A request's life mirrors the OpenAI server's (serve.app.Run: submit, read outputs, stop strings,
abort on close): checked in `execute` (a refusal raised, naming the input) → rendered, tokenized
and its grammar compiled (in `execute` for a small prompt; for a large one on the event loop, the
tokenizing in a prompt worker process as the OpenAI server does, so one huge prompt does not hold
up the intake of others) → admit → stream responses → the final one flagged COMPLETE_FINAL. A
client that cancels is noticed by polling the response sender; the request is aborted at once,
which frees its cache blocks.

A stopped engine (a multi-rank engine whose rank died, hung or failed: ``llm.health()`` not ok,
or the engine thread gone) is answered, in `execute` and for the requests it ends in flight, with
an UNAVAILABLE error naming the cause; Triton's readiness cannot be withdrawn from inside a Python
model, so every request says it until the model is reloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import sys
import threading
import types
import uuid
from pathlib import Path
from typing import Any, Iterator

from k3trt.runtime.xtml import DeltaKind
from k3trt.serve import metrics
from k3trt.serve.app import Run
from k3trt.serve.engine_loop import EngineLoop, Overloaded, engine_health, finish_unless
from k3trt.runtime.params import RequestError
from k3trt.runtime.media import UNTRUSTED
from k3trt.serve.adapt import with_images
from k3trt.serve.guided import compile_guided
from k3trt.serve.prompts import LARGE_PROMPT_CHARS, PromptWorkers
from k3trt.serve.protocol import DEFAULT_MAX_PROMPT_CHARS, APIError, bad
from k3trt.triton.metrics import TritonMetrics, forward_logs, output_tensors
from k3trt.triton.requests import Checked, Job, check, plan, prompt_bytes
from k3trt.triton.schema import ACK_PARAMETER, ERROR_PREFIX

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05
METRICS_PERIOD_S = 0.5


class EngineModel:
    def initialize(self, args: dict[str, Any], params: dict[str, str]) -> None:
        # here, not at the top: the stub provides pb, and the engine's heavy imports wait for an instance
        import torch  # noqa: PLC0415 (heavy: waits for a model instance)
        import triton_python_backend_utils as pb  # noqa: PLC0415 (optional: only inside Triton's backend)

        from k3trt.runtime.llm import LLM  # noqa: PLC0415 (heavy: waits for a model instance)
        self.pb = pb
        forward_logs(pb)
        cfg = json.loads(args["model_config"])
        self.name, self.instance = cfg["name"], args.get("model_instance_name", cfg["name"])
        if int(params.get("torch_threads") or 0) > 0:
            torch.set_num_threads(int(params["torch_threads"]))
        # KIND_MODEL: a multi-rank engine's one instance, whose ranks take GPUs 0..N-1 (repository.py)
        kind = args.get("model_instance_kind")
        device = {"CPU": "cpu", "MODEL": "cuda"}.get(kind) or f"cuda:{args['model_instance_device_id']}"
        mw = params.get("json_max_whitespace", "")
        self.json_max_whitespace = int(mw) if mw else None
        self.max_prompt_chars = int(params.get("max_prompt_chars") or DEFAULT_MAX_PROMPT_CHARS)
        _spawn_with_python()           # before the LLM: a multi-rank engine spawns its ranks while it loads
        self.llm = LLM(params["engine_dir"], device=device, **json.loads(params.get("engine_options") or "{}"))
        if self.llm.tokenizer is None:
            raise RuntimeError(f"{params['engine_dir']}: the engine dir has no tokenizer; Triton serving needs one")
        self.prompts = PromptWorkers(self.llm.tokenizer)
        self.engine = EngineLoop(self.llm, max_pending=self.llm.config.max_batch + int(params.get("max_queue", 256)))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="k3trt-triton", daemon=True)
        self._thread.start()
        self.engine.start(self.loop)
        self.metrics = TritonMetrics(pb, {"model": self.name, "instance": self.instance})
        self._metrics_task = asyncio.run_coroutine_threadsafe(self._publish_metrics(), self.loop)
        log.info("k3trt model %s ready on %s (max_batch %d)", self.instance, device, self.llm.config.max_batch)

    # ---- stub thread ----------------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        """Each request is read and validated here; a small one is also tokenized and its grammar
        compiled here, before it is handed to the event loop. A refused request gets its INVALID_ARG
        error response (a 400) here; Triton counts a request as failed (nv_inference_request_failure)
        only when `execute` raises (an error response counts as a success), so `execute` then raises
        too when the request is alone in its batch (always: the model has no dynamic batching). The
        raised error reaches no client: the request's final response has gone out already. What a
        large prompt's tokenizing refuses (a prompt longer than the model takes) is answered later,
        from the event loop, and so is not counted. A caller that sets the request parameter
        ACK_PARAMETER (the unary front) gets an empty non-final response once its request is taken."""
        for request in requests:
            sender = _Sender(request.get_response_sender(), self.pb)
            rid = f"{self.name}-{request.request_id() or uuid.uuid4().hex[:12]}-{uuid.uuid4().hex[:8]}"
            try:
                self._check_engine()
                raw = self._inputs(request)
                checked = self._check(raw)
                size = prompt_bytes(raw)
                job, params = (None, []) if size >= LARGE_PROMPT_CHARS else self._prepare_now(checked)
            except _Refused as e:
                sender.error(e.kind, e.message)
                if len(requests) == 1:
                    raise self.pb.TritonModelException(ERROR_PREFIX[e.kind] + e.message)
                continue
            if _wants_ack(request):
                sender.ack()
            asyncio.run_coroutine_threadsafe(self._serve(rid, sender, checked, size, job, params), self.loop)
        return None

    def _check_engine(self) -> None:
        """Refuse (UNAVAILABLE) while the engine cannot run: no request waits on a stopped engine."""
        reason = self._unavailable()
        if reason is not None:
            raise _Refused("UNAVAILABLE", f"the engine is unavailable: {reason} (reload the model)")

    def _unavailable(self) -> str | None:
        """Why the engine cannot run, or None. Its health check is a multi-rank engine's look at its
        ranks (the HTTP server's /health makes the same call off the engine thread)."""
        if not self.engine.alive:
            return "its engine thread has stopped"
        if self.engine.unavailable:
            return self.engine.unavailable
        h = engine_health(self.llm)
        return None if h["ok"] else h.get("error") or "the engine reports it is not healthy"

    def _inputs(self, request: Any) -> dict:
        try:
            return {t.name(): t.as_numpy() for t in request.inputs()}
        except Exception as e:            # tensors the stub cannot read: refuse this request only
            log.exception("reading the inputs of request %r failed", request.request_id())
            raise _Refused("INVALID_ARG", f"could not read the inputs: {e}") from None

    def _check(self, raw: dict) -> Checked:
        with _refusal():
            return check(raw, model=self.name, max_prompt_chars=self.max_prompt_chars)

    def _plan_kw(self) -> dict[str, Any]:
        return {"max_model_len": self.llm.max_model_len, "vocab_size": self.llm.vocab_size,
                "json_max_whitespace": self.json_max_whitespace}

    def _prepare_now(self, checked: Checked) -> tuple[Job, list]:
        with _refusal():
            job = plan(checked, self.llm.tokenizer, **self._plan_kw())
            for spec in _grammars(job):
                _compiled(self.llm, spec)
        return job, _with_grammar(job)

    async def _prepare_later(self, checked: Checked, size: int) -> tuple[Job, list]:
        with _refusal():
            job = await self.prompts.plan(plan, size, checked, self.llm.tokenizer, **self._plan_kw())
            for spec in _grammars(job):
                await compile_guided(self.llm, spec)
        return job, _with_grammar(job)

    def finalize(self) -> None:
        self._metrics_task.cancel()
        self.engine.stop()                    # aborts what is in flight
        self.prompts.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.metrics.close()
        self.llm.close()
        log.info("k3trt model %s stopped", self.instance)

    # ---- event loop -----------------------------------------------------------------------------
    async def _serve(self, rid: str, sender: "_Sender", checked: Checked, size: int, job: Job | None,
                     params: list) -> None:
        run, admitted = None, False
        try:
            if job is None:
                job, params = await self._prepare_later(checked, size)
            if job.submission.images:       # decoded and resized off the event loop
                with _refusal():
                    sub = await asyncio.to_thread(with_images, job.submission, self.llm.images, UNTRUSTED,
                                                  max_model_len=self.llm.max_model_len, field="images")
                job, params = dataclasses.replace(job, submission=sub), [
                    dataclasses.replace(p, max_tokens=q.max_tokens) for p, q in zip(params, sub.params)]
            self.engine.admit(len(params))
            admitted = True
            # Run needs only .engine and .llm of the server's state
            run = Run(types.SimpleNamespace(engine=self.engine, llm=self.llm), job.submission, params, rid)
            await self._respond(run, job, sender, rid)
        except _Refused as e:
            log.info("request %s refused: %s", rid, e.message)
            sender.error(e.kind, e.message)
        except Overloaded as e:
            sender.error("UNAVAILABLE", f"the server is busy ({e}); retry later")
        except Exception as e:
            reason = self._unavailable()
            if reason is not None:      # the engine stopped under this request
                log.error("request %s failed: the engine is unavailable: %s", rid, reason)
                sender.error("UNAVAILABLE", f"the engine is unavailable: {reason} (reload the model)")
            else:
                log.exception("request %s failed", rid)
                sender.error("INTERNAL", f"{type(e).__name__}: {e}")
        finally:
            if run is not None:
                run.close()                   # aborts the engine request if still live, frees its blocks
            elif admitted:
                self.engine.release(len(params))

    async def _respond(self, run: Run, job: Job, sender: "_Sender", rid: str) -> None:
        prompt_tokens = len(job.submission.prompts[0])

        async def consume() -> None:
            async for cs, upd in run.updates():
                if cs.finish_reason == "error":
                    raise RuntimeError(cs.error or "generation failed")
                if job.stream:
                    text, reasoning = _split(upd.deltas)
                    if upd.finished:
                        sender.send(self._final(cs, prompt_tokens, text, reasoning), final=True)
                    elif text or reasoning:
                        sender.send({"text_output": text, "reasoning_output": reasoning})
            if not job.stream:
                cs = next(iter(run.streams.values()))
                sender.send(self._final(cs, prompt_tokens, "".join(cs.content), "".join(cs.reasoning)),
                           final=True)

        async def cancelled() -> None:
            while not sender.cancelled():
                await asyncio.sleep(CANCEL_POLL_S)

        # an engine error raises out of finish_unless: answered as INTERNAL
        if not await finish_unless(consume(), cancelled()):
            run.close()                           # abort now: the blocks are free before we answer
            log.info("request %s cancelled by the client: aborted, its cache blocks freed", rid)
            sender.error("CANCELLED", "the client cancelled the request")

    def _final(self, cs: Any, prompt_tokens: int, text: str, reasoning: str) -> dict[str, Any]:
        stats = dict(getattr(cs, "stats", None) or {})
        drafted, accepted = stats.get("drafted_tokens") or 0, stats.get("accepted_tokens") or 0
        return {"text_output": text, "reasoning_output": reasoning,
                "tool_calls": json.dumps(cs.message({}).get("tool_calls", []), ensure_ascii=False),
                "finish_reason": cs.final_reason(), "prompt_tokens": prompt_tokens,
                "completion_tokens": len(cs.token_ids), "drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "stats": json.dumps(stats, default=str)}

    async def _publish_metrics(self) -> None:
        while True:
            try:
                self.metrics.update(metrics.render(await self.engine.stats(), self.engine))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("publishing metrics failed; metrics stay as they were")
            await asyncio.sleep(METRICS_PERIOD_S)


class _Refused(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


@contextlib.contextmanager
def _refusal() -> Iterator[None]:
    """An APIError raised inside becomes a refusal naming the input (INVALID_ARG)."""
    try:
        yield
    except APIError as e:
        where = f"{e.param}: " if e.param and not e.message.startswith(e.param) else ""
        raise _Refused("INVALID_ARG", where + e.message) from None


def _grammars(job: Job) -> list:
    """The grammars to compile before admitting (a grammar xgrammar refuses is a 400)."""
    sub = job.submission
    return [*sub.checks, *([sub.guided[0]] if sub.guided is not None else [])]


def _with_grammar(job: Job) -> list:
    params = list(job.submission.params)
    if job.submission.guided is not None:
        params = [dataclasses.replace(p, guided=job.submission.guided[0]) for p in params]
    return params


def _wants_ack(request: Any) -> bool:
    try:
        return bool(json.loads(request.parameters() or "{}").get(ACK_PARAMETER))
    except (AttributeError, ValueError):
        return False


def _spawn_with_python() -> None:
    """Prompt workers and a multi-rank engine's ranks are spawned processes: inside Triton's stub, sys.executable may be the stub
    binary rather than a Python, so the environment's own python3 is named (a process-wide
    setting: the stub process holds this one model instance only)."""
    exe = Path(sys.executable)
    if not exe.name.startswith("python"):
        candidate = Path(sys.exec_prefix) / "bin" / "python3"
        if candidate.is_file():
            multiprocessing.set_executable(str(candidate))


def _compiled(llm: Any, spec: Any) -> None:
    """Compile `spec` in the engine's grammar cache, waiting for it; a refused grammar is an APIError."""
    try:
        llm.compile_guided(spec).result()
    except RequestError as e:             # GrammarError is a RequestError
        raise bad(e.field, e.message) from None


def _split(deltas: list) -> tuple[str, str]:
    text = "".join(d.text for d in deltas if d.kind is DeltaKind.CONTENT)
    return text, "".join(d.text for d in deltas if d.kind is DeltaKind.REASONING)


class _Sender:
    """One request's response sender. Once the final response is out, Triton frees the request's
    response factory, and asking it anything more (is_cancelled) crashes the server (seen with
    Triton 2.51): so the final flag is remembered and nothing is asked after it."""

    def __init__(self, sender: Any, pb: Any):
        self.sender, self.pb, self.done = sender, pb, False

    def cancelled(self) -> bool:
        return not self.done and self.sender.is_cancelled()

    def ack(self) -> None:
        """An empty non-final response: the request was taken (the unary front waits for it)."""
        if not self.done:
            self.sender.send(self.pb.InferenceResponse(output_tensors=[]), flags=0)

    def send(self, fields: dict[str, Any], final: bool = False) -> None:
        if self.done:
            return
        response = self.pb.InferenceResponse(output_tensors=output_tensors(self.pb, fields))
        self.done = final
        self.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def error(self, kind: str, message: str) -> None:
        """A final error response; `kind` is a TritonError code name (schema.ERROR_PREFIX)."""
        if self.done:
            return
        self.done = True
        try:
            error = self.pb.TritonError(ERROR_PREFIX[kind] + message, getattr(self.pb.TritonError, kind))
            response = self.pb.InferenceResponse(error=error)
            self.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:                     # the client is gone: nobody to tell
            log.warning("could not deliver the error %r", message, exc_info=True)
