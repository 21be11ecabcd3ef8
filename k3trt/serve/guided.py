"""Structured output for the server: a request's GuidedSpec is compiled before the request is
admitted, through the engine's own grammar cache (``LLM.compile_guided``, the runtime's one compile
path); the spec then rides on the request's SamplingParams (``guided``), the step loop finds the
compiled grammar in that cache, and the runtime does the rest: it masks every logits row a request
gets in a step (the verify rows of its drafts included), cuts drafts at the first token the grammar
refuses, and commits only the tokens it accepts.

Why compile before admission and not leave it to the runtime: a grammar xgrammar refuses is then a
400 naming the field (in the runtime it would end the request with finish_reason "error").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from k3trt.runtime.params import RequestError
from k3trt.runtime.structured import GuidedSpec
from k3trt.serve.protocol import APIError, bad

log = logging.getLogger(__name__)


async def compile_guided(llm: Any, spec: GuidedSpec, param: str | None = None) -> None:
    """Compile `spec` in the engine's grammar cache (off the event loop and the step loop); a
    grammar xgrammar refuses is a 400 naming the field."""
    try:
        await asyncio.wrap_future(llm.compile_guided(spec))
    except RequestError as e:          # GrammarError is a RequestError
        raise bad(e.field if param is None else f"{param}.{e.field}", e.message) from None
    except Exception as e:
        log.exception("grammar compile failed")
        raise APIError(500, f"grammar compile failed: {e}", type="server_error") from None
