"""The thread that owns the LLM: it runs `step()` while there is work and sleeps when there is none.

Nothing but this thread touches the LLM (it is not thread-safe). The event loop talks to it through
a command queue (add, abort, stats), and it hands each request's outputs back to that request's
asyncio.Queue with one `call_soon_threadsafe` per step. Admission control lives on the event-loop
side (`admit` / `release`), so the bound on queued work needs no lock: past it, callers get 429.

A step that raises is an engine fault, not a request's: every request in flight is failed (its
queue gets a finished output with finish_reason "error"), the fault is logged, the loop goes on.
When the LLM's health (``llm.health()``, where it has one: a multi-rank engine) then says it is
not ok (a rank died, hung or failed: RankFailure), the engine is unavailable: ``unavailable``
holds the reason, the routes answer 503 with it, and /health says so; the server stays up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from typing import Any, Coroutine

from k3trt.runtime.request import RequestOutput

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0


class Overloaded(Exception):
    pass


def failed(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, 0, [], "", [], True, finish_reason="error", error=message)


def engine_health(llm: Any) -> dict[str, Any]:
    """The LLM's ``health()`` ({"ok", "ranks", "error"}), or ok for an LLM without one; a health
    check that raises counts as not ok."""
    health = getattr(llm, "health", None)
    if health is None:
        return {"ok": True, "ranks": None, "error": None}
    try:
        return dict(health())
    except Exception as e:
        return {"ok": False, "ranks": None, "error": f"health check failed: {type(e).__name__}: {e}"}


class EngineLoop:
    def __init__(self, llm: Any, *, max_pending: int):
        self.llm, self.max_pending = llm, max_pending
        self.pending = 0                 # admitted choices not yet released (event-loop thread only)
        self.rejected = 0
        self.unavailable: str | None = None     # set by the engine thread once the engine cannot run
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, asyncio.Queue] = {}          # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # engine-thread counters, read through stats()
        self._finished: Counter = Counter()
        self._totals = Counter()
        self._rate: deque[tuple[float, int]] = deque()

    # ---- event-loop side ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="k3trt-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def admit(self, n: int) -> None:
        if self.pending + n > self.max_pending:
            self.rejected += 1
            raise Overloaded(f"{self.pending} requests in flight; the server takes at most {self.max_pending}")
        self.pending += n

    def release(self, n: int) -> None:
        self.pending -= n

    def submit(self, request_id: str, prompt_ids: list[int], params: Any, sink: asyncio.Queue) -> None:
        self._put(("add", request_id, prompt_ids, params, sink))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Cancel a request (reason "stop": the server found a stop string; it only labels metrics)."""
        self._put(("abort", request_id, reason))

    async def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        fut = asyncio.get_running_loop().create_future()
        self._put(("stats", fut))
        return await asyncio.wait_for(fut, timeout)

    def _put(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine loop started")
        while True:
            self._wake.clear()
            if not self._drain():
                break
            if not self.llm.has_unfinished():
                self._wake.wait()
                continue
            try:
                outs = self.llm.step()
            except Exception as e:     # an engine fault: fail what is in flight, keep serving
                log.exception("engine step failed; failing %d requests", len(self._sinks))
                self._check_health()
                why = f"engine unavailable: {self.unavailable}" if self.unavailable else \
                    f"engine step failed: {type(e).__name__}: {e}"
                outs = [failed(rid, why) for rid in self._sinks]
                for rid in list(self._sinks):
                    self.llm.abort(rid)
            self._rate.append((time.monotonic(), self.llm.counters["generated_tokens"]))
            while self._rate[0][0] < self._rate[-1][0] - RATE_WINDOW_S:
                self._rate.popleft()
            self._deliver(outs)
        for rid in list(self._sinks):
            self.llm.abort(rid)
        log.info("engine loop stopped")

    def _drain(self) -> bool:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "stop":
                return False
            try:
                self._command(cmd)
            except Exception:                # a fault in one command must not stop the thread
                log.exception("engine loop: command %r failed", cmd[:2])

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, sink = cmd
            try:
                self.llm.add_request(prompt, params, request_id=rid)
                self._sinks[rid] = sink
                self._totals["prompt_tokens"] += len(getattr(prompt, "ids", prompt))     # a MediaPrompt
            except Exception as e:       # validated before submission: a server bug, or a stopped engine
                log.exception("add_request %s failed", rid)
                self._check_health()
                why = f"engine unavailable: {self.unavailable}" if self.unavailable else f"{type(e).__name__}: {e}"
                self._send([(sink, failed(rid, why))])
        elif kind == "abort":
            if self._sinks.pop(cmd[1], None) is not None:
                self.llm.abort(cmd[1])            # frees its blocks and KDA slot now
                self._finished[cmd[2]] += 1
        elif kind == "stats":
            try:
                self._send_result(cmd[1], self._snapshot())
            except Exception as e:
                self._send_result(cmd[1], e)

    def _check_health(self) -> None:
        if self.unavailable is None:
            h = engine_health(self.llm)
            if not h["ok"]:
                self.unavailable = h.get("error") or "the engine reports it is not healthy"

    def _deliver(self, outs: list[RequestOutput]) -> None:
        batch = []
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue                  # aborted since: nobody is listening
            batch.append((sink, out))
            if out.finished:
                del self._sinks[out.request_id]
                self._finished[out.finish_reason or "stop"] += 1
                if out.stats.get("time_to_first_token_s") is not None:
                    self._totals["ttft_s"] += out.stats["time_to_first_token_s"]
                    self._totals["ttft_n"] += 1
        if batch:
            self._send(batch)

    def _send(self, batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
        def put() -> None:
            for sink, out in batch:
                sink.put_nowait(out)
        try:
            self._loop.call_soon_threadsafe(put)
        except RuntimeError:              # the event loop is closed: the server is shutting down
            pass

    def _send_result(self, fut: asyncio.Future, value: Any) -> None:
        def put() -> None:
            if not fut.done():
                fut.set_exception(value) if isinstance(value, Exception) else fut.set_result(value)
        try:
            self._loop.call_soon_threadsafe(put)
        except RuntimeError:
            pass

    def _snapshot(self) -> dict[str, Any]:
        llm = self.llm
        (t0, g0), (t1, g1) = (self._rate[0], self._rate[-1]) if self._rate else ((0, 0), (0, 0))
        recent = time.monotonic() - t1 < RATE_WINDOW_S
        return {**llm.stats(), "waiting": len(llm.scheduler.waiting), "running": len(llm.scheduler.running),
                "num_blocks": llm.cache.pool.num_blocks, "max_batch": llm.config.max_batch,
                "finished": dict(self._finished), "totals": dict(self._totals),
                "tokens_per_s": (g1 - g0) / (t1 - t0) if recent and t1 > t0 else 0.0}


async def finish_unless(work: Coroutine[Any, Any, None], stop: Coroutine[Any, Any, None]) -> bool:
    """Await `work` unless `stop` completes first (the client left or cancelled the request).
    Returns False when stopped (work is cancelled: closing its run aborts the engine requests);
    True when work finished, re-raising its exception if it failed. Shared by the HTTP server and
    the Triton model."""
    task, stopper = asyncio.ensure_future(work), asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False
    task.result()
    return True
