"""Per-request sampling parameters and the error for requests the engine will not take.

``SamplingParams`` is frozen and checked when constructed, so a bad request fails at submission
(with a message naming the field) and never inside a running step. ``from_dict`` is the entry for
untyped input (CLI, HTTP): unknown keys are an error, not silently dropped.

``guided`` (structured output) is a ``structured.GuidedSpec``, the one runtime type of a guided
request: a dict of its fields (e.g. ``{"json_schema": {...}}``, ``{"regex": "[a-z]+"}``,
``{"json_object": True, "max_whitespace": 2}`` to loosen the default JSON whitespace cap) or a
``structured.CompiledGuide`` (read as its spec) is turned into one here, once, so a bad schema
fails at submission as ``RequestError("guided.json_schema", ...)``. The engine compiles every spec
through its one grammar cache (``LLM.compile_guided``). ``speculative=False`` opts one request
out of the engine's speculative decoding.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

if TYPE_CHECKING:       # annotations only: structured/ imports this module (RequestError)
    from k3trt.runtime.structured import GuidedSpec

# A logits processor sees the request's generated ids so far and its fp32 logits row [V] and
# returns the row to sample from. It runs per request; an exception ends only that request.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0              # 0: greedy
    top_k: int = 0                        # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0       # HF style, over prompt and output tokens
    presence_penalty: float = 0.0         # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None               # None: drawn from the engine's seed sequence
    logprobs: int | None = None           # return the sampled token's and the top-n logprobs
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)
    speculative: bool = True              # False: never drafted, even when the engine speculates
    guided: GuidedSpec | None = None      # given as a GuidedSpec, a CompiledGuide or a dict of its fields

    def __post_init__(self) -> None:
        # accept lists / a single string from callers, store tuples (the dataclass is frozen)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "logits_processors"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        self._check()
        if self.guided is not None:
            object.__setattr__(self, "guided", _guided_spec(self.guided))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Nothing but the argmax is needed (the batched fast path)."""
        return (self.greedy and not self.logits_processors and self.logprobs is None
                and self.repetition_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SamplingParams":
        known = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise RequestError(key, f"unknown sampling parameter{hint}; known: {', '.join(known)}")
        try:
            return cls(**raw)
        except TypeError as e:   # e.g. a list where a number belongs
            raise RequestError("sampling_params", str(e)) from None

    def _check(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise RequestError(name, f"{msg}, got {getattr(self, name)!r}")

        def number(name: str, integral: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, int) if integral else isinstance(v, (int, float))
            need(ok and not isinstance(v, bool), name, "must be an integer" if integral else "must be a number")

        for name in ("max_tokens", "top_k"):
            number(name, integral=True)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            number(name)
        need(self.max_tokens > 0, "max_tokens", "must be > 0")
        need(self.temperature >= 0, "temperature", "must be >= 0")
        need(self.top_k >= 0, "top_k", "must be >= 0 (0 turns it off)")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             "seed", "must be an integer or None")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             "logprobs", f"must be None or an integer in 0..{MAX_LOGPROBS}")
        need(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        need(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
             f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers")
        need(all(callable(p) for p in self.logits_processors), "logits_processors", "must be callables")
        need(isinstance(self.speculative, bool), "speculative", "must be a bool")


def _guided_spec(value: Any) -> GuidedSpec:
    """The GuidedSpec of what a caller passes as ``guided`` (module doc). Imported here, not at the
    top: structured/ imports this module, and xgrammar is only needed by requests that ask for it."""
    try:
        from k3trt.runtime.structured import (  # noqa: PLC0415 (cycle: structured imports this module)
            CompiledGuide, GrammarError, GuidedSpec)
    except ImportError as e:
        raise RequestError("guided", f"structured output is unavailable: {e}") from None
    if isinstance(value, GuidedSpec):
        return value
    if isinstance(value, CompiledGuide):
        return value.spec
    if not isinstance(value, Mapping):
        raise RequestError("guided", f"must be a GuidedSpec or a dict of its fields, got {type(value).__name__}")
    known = [f.name for f in dataclasses.fields(GuidedSpec)]
    for key in value:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RequestError(f"guided.{key}", f"unknown field{hint}; known: {', '.join(known)}")
    try:
        return GuidedSpec(**value)
    except GrammarError as e:
        raise GrammarError(f"guided.{e.field}", e.message) from None
    except ImportError as e:
        raise RequestError("guided", f"structured output is unavailable: {e}") from None
