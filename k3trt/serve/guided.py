"""Structured output for the server: compile a GuidedSpec off the event loop, and attach it to a
request's SamplingParams.

THE SEAM. The runtime's step loop does not take a grammar yet (the structured package documents how
it will: `request.guided.fill_masks(drafts, ...)` before the forward, `commit(accepted)` after).
Until it does, `attach` drives the same `GuidedState` from a logits processor: before each sample
it commits the tokens generated since its last call and masks the row with the grammar's next-token
mask. That is exact without speculative drafts (one logits row per step, which is all the runtime
runs today). When the runtime takes the spec natively, `attach` becomes
`dataclasses.replace(params, guided=compiled)` (or whatever field it picks) and GuidedProcessor goes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any

from k3trt.runtime.params import SamplingParams
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

    async def compile(self, spec: Any, param: str | None) -> Any:
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


class GuidedProcessor:
    """One request's grammar as a logits processor (see the module doc). Runs on the engine thread."""

    def __init__(self, guide: Any):
        from k3trt.runtime.structured import apply_masks
        self._apply = apply_masks
        self.state = guide.new_state()
        self.bitmask = guide.vocab.allocate_bitmask(1)

    def __call__(self, output_ids: list[int], logits):
        if logits.dim() != 1:
            raise RuntimeError("grammar via logits processor needs one row per step (no speculative drafts)")
        new = output_ids[self.state.num_committed:]
        if new:
            self.state.commit(new)        # raises GrammarError if a token broke the grammar: fails this request
        self.state.fill_masks([], self.bitmask, 0)
        return self._apply(logits[None], self.bitmask)[0]


def attach(params: SamplingParams, guide: Any) -> SamplingParams:
    """params that make the runtime follow `guide` (a CompiledGuide); the mask runs before any other
    processor (logit_bias), so a bias can never revive a token the grammar forbids."""
    return dataclasses.replace(params, logits_processors=(GuidedProcessor(guide), *params.logits_processors))
