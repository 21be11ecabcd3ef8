"""The HTTP routes: /v1/chat/completions, /v1/completions (SSE or whole), /v1/models, /health, /metrics.

A request's life: read the body (415 unless JSON, 413 past the byte bound, counted as the bytes
arrive, so a chunked upload is bounded too) → validate (400 naming the field) → render / encode the prompt off the event loop →
compile its grammar, if any (400 for a schema xgrammar refuses) → admit (429 past the bound) →
submit one engine request per choice → read outputs until every choice is done. `Run.close()` runs
exactly once however that ends (done, client gone, error): it aborts what is still running, which
frees its cache blocks at once, and gives the admission back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from k3trt.runtime.media import UNTRUSTED, FilePolicy
from k3trt.serve import metrics
from k3trt.serve.adapt import Submission, chat_submission, completion_submission, image_chars, with_images
from k3trt.serve.engine_loop import EngineLoop, Overloaded, engine_health, finish_unless
from k3trt.serve.guided import compile_guided
from k3trt.serve.output import ChoiceStream, Update
from k3trt.serve.prompts import PromptWorkers
from k3trt.serve.protocol import APIError, ChatRequest, CompletionRequest, parse_json, validate
from k3trt.serve.responses import Envelope, sse, usage

log = logging.getLogger(__name__)

JSON_TYPES = ("application/json",)


@dataclass
class ServerState:
    llm: Any
    engine: EngineLoop
    model_name: str
    api_key: str | None
    json_max_whitespace: int | None
    retry_after_s: int
    started: int
    max_prompt_chars: int | None = None
    max_body_bytes: int = 64 << 20
    prompts: PromptWorkers | None = None     # None: made from the LLM's tokenizer
    files: FilePolicy = UNTRUSTED            # which local files image_url file:// may name
    owns_llm: bool = False          # built by the server: closed with it


class Run:
    """One HTTP request's engine requests (one per choice)."""

    def __init__(self, st: ServerState, sub: Submission, params: list, rid: str):
        self.engine, self.queue = st.engine, asyncio.Queue()
        tok = st.llm.tokenizer
        self.streams = {f"{rid}-{i}": ChoiceStream(i, tok, sub.stops, sub.thinking, sub.drop_tool_calls)
                        for i in range(len(params))}
        self.live, self.closed = set(self.streams), False
        for i, (r, p) in enumerate(zip(self.streams, params)):
            self.engine.submit(r, sub.media or list(sub.prompt_of(i)), p, self.queue)

    async def updates(self) -> AsyncIterator[tuple[ChoiceStream, Update]]:
        while self.live:
            out = await self.queue.get()
            cs = self.streams.get(out.request_id)
            if cs is None or cs.done:
                continue
            upd = cs.update(out)
            if cs.done:
                self.live.discard(out.request_id)
                if not out.finished:         # a stop string the server found: the engine runs on
                    self.engine.abort(out.request_id, "stop")
            yield cs, upd

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for r in self.live:
                self.engine.abort(r)
            self.engine.release(len(self.streams))


class _Stream(StreamingResponse):
    """SSE whose Run is closed when the response ends, however it ends (Starlette cancels the body
    iterator when the client disconnects; a generator never started would skip its own finally)."""

    def __init__(self, body: AsyncIterator[bytes], run: Run):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def _state(request: Request) -> ServerState:
    st: ServerState = request.app.state.k3
    if st.api_key is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {st.api_key}".encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
    return st


async def _body(request: Request, limit: int) -> bytes:
    """The body, refused as it arrives once past `limit` bytes (content-length is only a claim)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in JSON_TYPES:
        raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                       code="unsupported_media_type")
    too_big = APIError(413, f"The request body exceeds this server's limit of {limit} bytes",
                       code="request_too_large")
    claimed = request.headers.get("content-length", "")
    if claimed.isdigit() and int(claimed) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _completions(request: Request, chat: bool) -> Response:
    st = _state(request)
    raw = await _body(request, st.max_body_bytes)
    req = validate(ChatRequest if chat else CompletionRequest, parse_json(raw), st.max_prompt_chars)
    if req.model != st.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{st.model_name}`",
                       param="model", code="model_not_found")
    llm = st.llm
    if st.engine.unavailable:
        raise _unavailable(st.engine.unavailable)
    if chat:        # the body's size stands in for the prompt's: it bounds it
        sub = await st.prompts.plan(chat_submission, len(raw) - image_chars(req), req, llm.tokenizer, max_model_len=llm.max_model_len,
                                    json_max_whitespace=st.json_max_whitespace)
    else:
        sub = await st.prompts.plan(completion_submission, len(raw), req, llm.tokenizer, vocab_size=llm.vocab_size,
                                    max_model_len=llm.max_model_len, json_max_whitespace=st.json_max_whitespace)
    sub = await asyncio.to_thread(with_images, sub, llm.images, st.files, max_model_len=llm.max_model_len)
    n = len(sub.params)
    if n > st.engine.max_pending:     # would never fit: not worth a retry
        raise APIError(400, f"{n} choices exceed this server's limit of {st.engine.max_pending}", param="n")
    try:
        st.engine.admit(n)
    except Overloaded as e:
        raise APIError(429, f"The server is busy: {e}. Retry later.", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(st.retry_after_s)}) from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    env = Envelope(rid, st.model_name, int(time.time()), chat, llm.tokenizer, sub.logprobs)
    run = None
    try:
        params = list(sub.params)
        for spec in sub.checks:
            await compile_guided(llm, spec)
        if sub.guided is not None:      # the runtime makes one matcher per choice from the shared grammar
            for spec in sub.guided:
                await compile_guided(llm, spec)
            params = [dataclasses.replace(p, guided=sub.guided[i // sub.n]) for i, p in enumerate(params)]
        run = Run(st, sub, params, rid)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return _Stream(_stream(run, env, sub, include, llm.tokenizer), run)
        return await _whole(run, env, sub, request, llm.tokenizer)
    except BaseException:
        if run is None:
            st.engine.release(n)
        raise
    finally:
        if run is not None and not req.stream:
            run.close()


async def _stream(run: Run, env: Envelope, sub: Submission, include_usage: bool, tok: Any) -> AsyncIterator[bytes]:
    offsets = {}
    for cs in run.streams.values():
        if env.chat:
            yield sse(env.role_chunk(cs.index))
        elif sub.echo:
            text = tok.decode(sub.prompt_of(cs.index))
            offsets[cs.index] = len(text)
            yield sse(env.head([{"index": cs.index, "text": text, "logprobs": None, "finish_reason": None}]))
    async for cs, upd in run.updates():
        if cs.finish_reason == "error":
            yield sse(_generation_error(run.engine, cs.error).body())
            return
        for chunk in env.chunks(cs, upd, offsets.get(cs.index, 0)):
            yield sse(chunk)
        offsets[cs.index] = offsets.get(cs.index, 0) + sum(len(d.text) for d in upd.deltas)
    if include_usage:
        yield sse(env.usage_chunk(usage(sum(map(len, sub.prompts)), list(run.streams.values()))))
    yield sse("[DONE]")


async def _whole(run: Run, env: Envelope, sub: Submission, request: Request, tok: Any) -> Response:
    logprobs: dict[int, list] = {cs.index: [] for cs in run.streams.values()}

    async def consume() -> None:
        async for cs, upd in run.updates():
            logprobs[cs.index] += upd.logprobs

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    if not await finish_unless(consume(), disconnected()):     # the client left: close() aborts its requests
        log.info("%s: client disconnected before the answer was ready", env.id)
        return Response(status_code=499)
    streams = list(run.streams.values())
    for cs in streams:
        if cs.finish_reason == "error":
            raise _generation_error(run.engine, cs.error)
    echo = {cs.index: tok.decode(sub.prompt_of(cs.index)) for cs in streams} if sub.echo else None
    return JSONResponse(env.whole(streams, logprobs, usage(sum(map(len, sub.prompts)), streams), echo))


# ---- small routes ---------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    st = _state(request)
    card = {"id": st.model_name, "object": "model", "created": st.started, "owned_by": "k3trt",
            "max_model_len": st.llm.max_model_len}
    if "model" in request.path_params:
        if request.path_params["model"] != st.model_name:
            raise APIError(404, f"The model `{request.path_params['model']}` does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(card)
    return JSONResponse({"object": "list", "data": [card]})


def _unavailable(reason: str) -> APIError:
    return APIError(503, f"The engine is unavailable: {reason}", type="server_error", code="engine_unavailable")


def _generation_error(engine: EngineLoop, error: str | None) -> APIError:
    """A request that ended in an engine fault: 503 once the engine cannot run (a stopped
    multi-rank engine), else 500."""
    if engine.unavailable:
        return _unavailable(engine.unavailable)
    return APIError(500, error or "generation failed", type="server_error")


async def health(request: Request) -> Response:
    st = request.app.state.k3
    if not st.engine.alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    # off the event loop: a multi-rank engine's check may wait briefly for a failed rank's report
    h = await asyncio.to_thread(engine_health, st.llm)
    if not h["ok"]:
        return JSONResponse({"status": "engine unavailable", "error": h.get("error"), "ranks": h.get("ranks")},
                            status_code=503)
    return JSONResponse({"status": "ok"})


async def prometheus(request: Request) -> Response:
    st = _state(request)        # behind --api-key too: the counters describe the traffic
    return PlainTextResponse(metrics.render(await st.engine.stats(), st.engine), media_type=metrics.CONTENT_TYPE)


def _api(handler):
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            if e.status >= 500:
                log.error("%s %s: %s", request.method, request.url.path, e.message)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return JSONResponse(APIError(500, "Internal server error", type="server_error").body(), status_code=500)
    return wrapped


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                 type=kind).body(), status_code=exc.status_code)


def create_app(st: ServerState) -> Starlette:
    if st.prompts is None:
        st.prompts = PromptWorkers(st.llm.tokenizer)
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        st.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(st.engine.stop)
            st.prompts.close()
            if st.owns_llm:
                st.llm.close()

    routes = [Route("/v1/chat/completions", _api(lambda r: _completions(r, chat=True)), methods=["POST"]),
              Route("/v1/completions", _api(lambda r: _completions(r, chat=False)), methods=["POST"]),
              Route("/v1/models", _api(models), methods=["GET"]),
              Route("/v1/models/{model:path}", _api(models), methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", _api(prometheus), methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.k3 = st
    return app
