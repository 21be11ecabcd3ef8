"""Structured output for the server: compile a request's GuidedSpec off the event loop; the compiled
guide then rides on the request's SamplingParams (`guided`), and the runtime does the rest: it masks
every logits row a request gets in a step (the verify rows of its drafts included), cuts drafts at
the first token the grammar refuses, and commits only the tokens it accepts.

Why compile here and not let the runtime do it from the spec: a grammar xgrammar refuses is then a
400 naming the field before the request is admitted (in the runtime it would end the request with
finish_reason "error"), and a runtime handed a CompiledGuide never builds a vocabulary of its own,
so the server holds one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from k3trt.serve.protocol import APIError, bad

log = logging.getLogger(__name__)


class Grammars:
    """The engine's GrammarVocab and GrammarCache, built on first use (the vocabulary walk takes a
    second or two and most servers never see a grammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self.vocab = self.cache = None

    def _ready(self) -> None:
        with self._lock:
            if self.cache is None:
                from k3trt.runtime.structured import GrammarCache, GrammarVocab
                self.vocab = GrammarVocab(self._tokenizer, vocab_size=self._vocab_size)
                self.cache = GrammarCache()

    async def compile(self, spec: Any, param: str | None = None) -> Any:
        """The CompiledGuide for `spec`; a grammar xgrammar refuses is a 400 naming the field."""
        from k3trt.runtime.params import RequestError
        await asyncio.to_thread(self._ready)
        try:
            return await asyncio.wrap_future(self.cache.submit(spec, self.vocab))
        except RequestError as e:
            raise bad(e.field if param is None else f"{param}.{e.field}", e.message) from None
        except Exception as e:
            log.exception("grammar compile failed")
            raise APIError(500, f"grammar compile failed: {e}", type="server_error") from None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
