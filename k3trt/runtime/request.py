"""One request's record: its tokens, where its cache lives, its sampler state, its text, its stats.

Everything a request owns (cache blocks, KDA slot, RNG, detokenizer, drafts and the drafter's
state for it, grammar matcher, image embeddings) hangs off this record and is released by ``StepLoop.finish`` in one
place, however the request ends. ``new_request`` checks a submission (errors name the field).
When a request ends is decided here and nowhere else: ``room`` is the one reading of max_tokens
and max_model_len, ``block_end`` cuts an emitted block at EOS / stop ids / that room, and
``append_token`` commits one token of the cut block and matches stop strings. Token accounting:
``token_ids`` = prompt + generated; the first ``num_computed`` of them are in the caches. A request
that is decoding has exactly one token not yet computed (the last sampled one); speculative drafts
(``drafts``, with their draft distributions ``draft_q`` when the drafter sampled them) ride on top
of it in the next verify step. A guided request waits in the queue (``ready`` False) until its
grammar is compiled (``guide_future``), then holds its matcher in ``guided``.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from k3trt.runtime.adaptive_k import KState, k_used_stats
from k3trt.runtime.media import ImageInput
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.runtime.structured.runtime import check_guided

if TYPE_CHECKING:       # annotations only: structured output imports xgrammar lazily
    from k3trt.runtime.structured.state import GuidedState


class Status(enum.Enum):
    WAITING = "waiting"        # queued (new, or preempted: caches dropped, recomputed on resume)
    RUNNING = "running"        # holds a KDA slot and cache blocks
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"              # EOS, a stop token id or a stop string
    LENGTH = "length"          # max_tokens or the engine's max_model_len
    ABORT = "abort"            # cancelled by the caller
    ERROR = "error"            # a fault confined to this request (see Request.error)


@dataclass
class RequestStats:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens served by the prefix cache (last admission)
    preemptions: int = 0
    drafted: int = 0            # speculative tokens verified / accepted
    accepted: int = 0
    verify_steps: int = 0       # verify steps that had drafts
    accepted_lengths: Counter = field(default_factory=Counter)   # n -> verify steps that accepted n
    k_used: Counter = field(default_factory=Counter)             # drafts asked for -> steps (adaptive_k.py)

    def to_dict(self, output_tokens: int) -> dict[str, Any]:
        end = self.finished or time.perf_counter()
        run = end - (self.first_scheduled or end)
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": output_tokens,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
            "time_to_first_token_s": None if self.first_token is None else self.first_token - self.arrival,
            "latency_s": end - self.arrival,
            "tokens_per_s": output_tokens / run if run > 0 else 0.0,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # tokens emitted per verify step that had drafts (n accepted + the target's token)
            "mean_accepted_length": (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else None,
            "accepted_length_histogram": {int(n): c for n, c in sorted(self.accepted_lengths.items())},
            **k_used_stats(self.k_used),
        }


@dataclass
class RequestOutput:
    """A snapshot of one request (``generate`` returns finished ones; ``stream`` yields deltas)."""
    request_id: str
    index: int                          # position in the caller's batch
    prompt_token_ids: list[int]         # one list shared by a request's snapshots: read, don't mutate
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None   # the stop string or token id that ended it
    error: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def find_stop(text: str, start: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after `start` (new text may complete one that
    began earlier): (its position, the string), or None."""
    lo = max(0, start - max(map(len, stops)) + 1)
    hits = [(i, s) for s in stops if (i := text.find(s, lo)) >= 0]
    return min(hits) if hits else None


@dataclass(eq=False)
class Request:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    # owned resources (released together by StepLoop.finish / Scheduler.preempt)
    blocks: list[int] = field(default_factory=list)
    kda_slot: int | None = None
    generator: torch.Generator | None = None
    detokenizer: Any = None
    drafts: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None  # [len(drafts), V] the drafts' distribution; None: one-hot
    seed: int | None = None              # the request's seed (sampling and sampled drafts)
    adaptive: KState | None = None       # its draft-length controller (adaptive_k.py); None: not drafting yet
    guide_future: Future | None = None   # Future[CompiledGuide] until the grammar is compiled
    guided: GuidedState | None = None    # its matcher once it is
    block_hashes: list[bytes] = field(default_factory=list)   # chain hashes of its full blocks
    images: tuple[ImageInput, ...] = ()  # its images' pixels, grids, hashes and placeholder spans
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)   # image -> encoder rows, until prefilled
    num_registered: int = 0             # leading blocks registered in the prefix cache
    # output
    text: str = ""
    emitted_text: int = 0               # characters of `text` already streamed
    emitted_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        # the prompt never changes: its length is read several times per request and step, and
        # snapshots share one copy of it (at batch 128 these were ~10% of a step's host time)
        self.num_prompt = len(self.prompt_ids)
        self._prompt_out = list(self.prompt_ids)
        self.stats.prompt_tokens = self.num_prompt
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def decoding(self) -> bool:
        """Every token but the last sampled one is cached: the next step is a verify (decode) step."""
        return self.num_computed == len(self.token_ids) - 1 and self.num_output > 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ready(self) -> bool:
        """Schedulable: not waiting for its grammar to compile."""
        return self.guide_future is None

    def set_drafts(self, drafts: list[int], q: torch.Tensor | None = None) -> None:
        self.drafts, self.draft_q = drafts, (q[:len(drafts)] if q is not None and drafts else None)

    def room(self, max_model_len: int) -> int:
        """How many more tokens the request may emit: the one place max_tokens (and the engine's
        max_model_len) bound its output. Drafts are sized by it too (Speculator.limit)."""
        return min(self.params.max_tokens - self.num_output, max_model_len - len(self.token_ids))

    def block_end(self, tokens: Sequence[int], eos_ids: frozenset[int],
                  max_model_len: int) -> tuple[int, tuple[FinishReason, int | None] | None]:
        """Where an emitted block (accepted drafts + the target's token) ends the request: (how many
        of its tokens to keep, (reason, stop_reason) if the last kept one ends it). A stop token (EOS
        unless ignore_eos, stop_token_ids) is kept and ends it; the block is cut to ``room``."""
        p, room = self.params, self.room(max_model_len)
        for i, t in enumerate(tokens[:max(room, 0)]):
            if t in eos_ids and not p.ignore_eos or t in p.stop_token_ids:
                return i + 1, (FinishReason.STOP, t)
            if i + 1 >= room:
                return i + 1, (FinishReason.LENGTH, None)
        return min(len(tokens), max(room, 0)), None

    def append_token(self, token: int, logprobs: dict[int, float] | None,
                     end: tuple[FinishReason, int | None] | None = None
                     ) -> tuple[FinishReason, str | int | None] | None:
        """Commit one token of a block cut by ``block_end`` (``end``: its verdict when this is the
        block's last token); returns (reason, stop_reason) when the request ends here. A stop token
        ends it before stop strings are matched, a stop string before the length limit."""
        p = self.params
        self.token_ids.append(token)
        if self.stats.first_token is None:
            self.stats.first_token = time.perf_counter()
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        start = len(self.text)
        if self.detokenizer is not None:
            self.text += self.detokenizer.feed(token)
        if end is not None and end[0] is FinishReason.STOP:
            return end
        if p.stop:
            hit = find_stop(self.text, start, p.stop)
            if hit is not None:
                at, s = hit
                self.text = self.text[:at + len(s) if p.include_stop_str_in_output else at]
                return FinishReason.STOP, s
        return end

    def pending_text(self, hold: int) -> str:
        """Text not yet streamed, keeping back the last `hold` characters (a possible stop-string
        prefix) unless the request has finished."""
        end = len(self.text) if self.finished else max(self.emitted_text, len(self.text) - hold)
        out, self.emitted_text = self.text[self.emitted_text:end], end
        return out

    def snapshot(self, hold: int = 0) -> RequestOutput:
        delta_text = self.pending_text(hold)
        delta_ids, self.emitted_tokens = self.output_ids[self.emitted_tokens:], self.num_output
        return RequestOutput(
            request_id=self.request_id, index=self.index, prompt_token_ids=self._prompt_out,
            text=self.text if self.finished else self.text[:self.emitted_text], token_ids=self.output_ids,
            finished=self.finished, finish_reason=self.finish_reason.value if self.finish_reason else None,
            stop_reason=self.stop_reason, error=self.error, delta_text=delta_text, delta_token_ids=delta_ids,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            stats=self.stats.to_dict(self.num_output))


def new_request(prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None, *, index: int,
                request_id: str, tokenizer: Any, vocab_size: int, max_model_len: int) -> Request:
    """A checked request: a RequestError names the field and the request's index in its batch.
    Text prompts are encoded with special-token strings recognised (as Hugging Face does)."""
    try:
        params = SamplingParams.from_dict(params) if isinstance(params, Mapping) else params or SamplingParams()
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError("prompt", "text prompts need the engine's tokenizer (the engine dir has none); "
                                             "pass token ids")
            ids = tokenizer.encode(prompt, allow_special=True)
        else:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
                raise RequestError("prompt", f"token ids must be integers in 0..{vocab_size - 1}")
        if not ids:
            raise RequestError("prompt", "is empty")
        if len(ids) >= max_model_len:
            raise RequestError("prompt", f"has {len(ids)} tokens; this engine allows at most {max_model_len - 1} "
                                         f"(max_model_len {max_model_len} counts the output too)")
        if params.stop and tokenizer is None:
            raise RequestError("stop", "stop strings need the engine's tokenizer (the engine dir has none)")
        if params.guided is not None:
            check_guided(params.guided, ids, tokenizer)
    except RequestError as e:
        raise RequestError(e.field, f"{e.message} (request {index})") from None
    return Request(request_id, index, ids, params)
