"""Where a request's prompt is rendered and tokenized: never on the event loop, and a large one not
even in the server's process.

A small prompt goes to a thread. A large one goes to a worker process with its own tokenizer:
measured on a 1M-character chat prompt, rendering and encoding in a thread still stalled the event
loop for about a second (the template's string work and the encoder's hand-offs keep taking the
GIL back), so `/health` and every other request waited; in a worker process they do not. The pool
starts with the first large prompt (spawned: it imports the runtime, which takes seconds once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

from k3trt.runtime.tokenizer import Tokenizer
from k3trt.serve.adapt import Submission

log = logging.getLogger(__name__)

LARGE_PROMPT_CHARS = 1 << 16        # below this a thread's stall is a few milliseconds


class PromptWorkers:
    """`plan(fn, chars, req, tokenizer, **kw)` = `fn(req, tokenizer, **kw)`, off the event loop."""

    def __init__(self, tokenizer: Any, processes: int = 1):
        # a worker rebuilds the tokenizer from its directory: only a k3trt Tokenizer says where that is
        self.tokenizer_dir = str(Path(tokenizer.source).parent) if isinstance(tokenizer, Tokenizer) else None
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    async def plan(self, fn: Callable[..., Submission], chars: int, req: Any, tokenizer: Any, **kw: Any) -> Submission:
        if chars < LARGE_PROMPT_CHARS or self.tokenizer_dir is None:
            return await asyncio.to_thread(fn, req, tokenizer, **kw)
        if self._pool is None:
            log.info("starting %d prompt worker process(es) for large prompts", self.processes)
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        return await asyncio.wrap_future(self._pool.submit(_plan, fn, self.tokenizer_dir, req, kw))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@functools.lru_cache(maxsize=1)
def _tokenizer(directory: str) -> Tokenizer:
    return Tokenizer.from_dir(directory)


def _plan(fn: Callable[..., Submission], directory: str, req: Any, kw: dict[str, Any]) -> Submission:
    return fn(req, _tokenizer(directory), **kw)
