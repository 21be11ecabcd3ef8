"""From a validated OpenAI request to a ``Submission``: what the engine runs (prompt ids, one
SamplingParams per choice, the GuidedSpec per prompt, if any) and how the output is to be read back.

A grammar's `after_reasoning` must say whether the prompt leaves a `think` block open (the runtime
refuses a mismatch): chat takes it from the thinking switch the template rendered with, a raw
completion prompt from its own text.

Stop strings are not handed to the runtime: the runtime matches them on text decoded without
special tokens, while chat output is read with the special tokens kept (XTML markers), so the
server decodes, matches stops and cuts the text itself (output.py) and aborts the request there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from k3trt.runtime.chat import chat_prompt
from k3trt.runtime.media import FilePolicy, ImageIntake, MediaPrompt
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.runtime.structured import GuidedSpec
from k3trt.runtime.xtml import OPEN, reasoning_open
from k3trt.serve.protocol import APIError, ChatRequest, CompletionRequest, bad


@dataclass(frozen=True)
class Submission:
    """One API request as engine requests: choice i runs prompts[i // n] with params[i]."""
    prompts: tuple[tuple[int, ...], ...]     # one per prompt; choice i uses prompts[i // n]
    params: tuple[SamplingParams, ...]       # one per choice (seeds differ by choice)
    stops: tuple[str, ...]
    thinking: bool | None                    # chat: how to parse the output; None: plain text
    logprobs: int | None                     # top-n alternatives per token; None: no logprobs
    guided: tuple[GuidedSpec, ...] | None = None   # per prompt; the caller compiles each before admission
    drop_tool_calls: bool = False            # tool_choice "none"
    echo: bool = False
    checks: tuple[GuidedSpec, ...] = ()      # compiled only to refuse a bad tool schema, never applied
    images: tuple[Any, ...] = ()             # chat: the image URLs, in prompt order (one MEDIA_PAD each)
    media: MediaPrompt | None = None         # with_images: the prompt with its images, as the engine takes it

    @property
    def n(self) -> int:
        return len(self.params) // len(self.prompts)

    def prompt_of(self, choice: int) -> tuple[int, ...]:
        return self.prompts[choice // self.n]


def _thinking(kwargs: dict[str, Any] | None) -> bool:
    kwargs = kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise bad(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key} must be a boolean")
            return kwargs[key]
    return True


def _messages(messages: list[dict]) -> list[dict]:
    """OpenAI tool results name their call by tool_call_id; the K3 template wants the tool's name."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        for c in m.get("tool_calls") or []:
            if isinstance(c.get("id"), str):
                names[c["id"]] = c["function"]["name"]
        if m.get("role") == "tool" and not m.get("name") and m.get("tool_call_id") in names:
            m = {**m, "name": names[m["tool_call_id"]]}
        out.append(m)
    return out


def chat_submission(req: ChatRequest, tokenizer: Any, *, max_model_len: int,
                    json_max_whitespace: int | None) -> Submission:
    thinking = _thinking(req.chat_template_kwargs)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if choice not in (None, "none", "auto") and not tools:
        raise bad("tool_choice", "tool_choice needs tools")
    try:
        chat = chat_prompt(tokenizer, _messages(req.messages), tools=None if choice == "none" else tools or None,
                           thinking=thinking)
        ids = chat.ids
    except ValueError as e:
        raise bad("messages", str(e)) from None
    guided = _guided_spec(req, tools, thinking, json_max_whitespace)
    # a tool the model may call must compile whatever tool_choice says: refused now, not mid-answer
    checks = () if guided is not None or not tools else (_spec(lambda s: s.for_tools(
        tools, "required", parallel_tool_calls=req.parallel_tool_calls, chat=True, after_reasoning=thinking,
        max_whitespace=json_max_whitespace), ""),)
    max_tokens = req.max_completion_tokens or req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(req, [ids], max_tokens, field, logprobs, max_model_len, "messages")
    return Submission((tuple(ids),), params, req.stop, thinking, logprobs, None if guided is None else (guided,),
                      drop_tool_calls=choice == "none", checks=checks, images=tuple(chat.images))


def image_chars(req: ChatRequest) -> int:
    """Characters of the chat's image URLs: data, not prompt text to render."""
    return sum(len(p["image_url"]["url"]) for m in req.messages if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") == "image_url")


def with_images(sub: Submission, intake: ImageIntake, files: FilePolicy, *, max_model_len: int,
                field: str = "messages") -> Submission:
    """The images read, checked and preprocessed, the prompt widened to their tokens (a thread's
    work: decoding and resizing); a bad image is a 400 naming `field`. max_tokens shrinks to what
    the widened prompt leaves, as the runtime would cut it."""
    if not sub.images:
        return sub
    try:
        media = intake.prepare(sub.prompts[0], sub.images, files)
    except RequestError as e:
        raise bad(field, e.message) from None
    n = len(media.ids)
    if n >= max_model_len:
        raise bad(field, f"This model's maximum context length is {max_model_len} tokens; the prompt has {n} "
                              "with its images", code="context_length_exceeded")
    params = tuple(dataclasses.replace(p, max_tokens=min(p.max_tokens, max_model_len - n)) for p in sub.params)
    return dataclasses.replace(sub, prompts=(tuple(media.ids),), params=params, media=media)


def completion_submission(req: CompletionRequest, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                          json_max_whitespace: int | None) -> Submission:
    raw = req.prompt
    many = isinstance(raw, list) and raw and not isinstance(raw[0], int)
    prompts = []
    for i, p in enumerate(raw if many else [raw]):
        at = f"prompt[{i}]" if many else "prompt"
        if isinstance(p, str):
            ids = tokenizer.encode(p, allow_special=True)   # a raw prompt is the caller's to shape
        elif not all(0 <= t < vocab_size for t in p):
            raise bad(at, f"token ids must lie in 0..{vocab_size - 1}")
        else:
            ids = list(p)
        if not ids:
            raise bad(at, "the prompt encodes to no tokens")
        prompts.append(ids)
    guided = None
    if req.response_format is not None and req.response_format.type != "text":
        fmt = req.response_format.model_dump(by_alias=True)
        guided = tuple(_spec(lambda s: s.from_response_format(fmt, after_reasoning=_reasoning_open(tokenizer, ids),
                                                              max_whitespace=json_max_whitespace),
                             "response_format") for ids in prompts)
    params = _params(req, prompts, req.max_tokens or 16, "max_tokens", req.logprobs, max_model_len, "prompt")
    return Submission(tuple(map(tuple, prompts)), params, req.stop, None, req.logprobs, guided, echo=req.echo)


def _reasoning_open(tokenizer: Any, ids: list[int]) -> bool:
    """The prompt ends inside a `think` block: as the runtime's check_guided reads it."""
    return OPEN in getattr(tokenizer, "special_ids", {}) and reasoning_open(tokenizer.decode(ids))


def _guided_spec(req: ChatRequest, tools: list[dict], thinking: bool, mw: int | None) -> GuidedSpec | None:
    kw = dict(chat=True, after_reasoning=thinking, max_whitespace=mw)
    constrained = req.tool_choice not in (None, "none", "auto")
    if constrained and req.response_format is not None and req.response_format.type != "text":
        raise bad("response_format", "response_format cannot be combined with tool_choice 'required' or a named tool")
    if constrained:
        choice = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else req.tool_choice
        return _spec(lambda s: s.for_tools(tools, choice, parallel_tool_calls=req.parallel_tool_calls, **kw), "")
    if req.response_format is not None:
        return _spec(lambda s: s.from_response_format(req.response_format.model_dump(by_alias=True), **kw),
                     "response_format")
    return None


def _spec(make: Callable[[type], GuidedSpec | None], prefix: str) -> GuidedSpec | None:
    """A GuidedSpec (checked: a bad schema fails here, naming the field); xgrammar is imported on the
    first one, so a server without it fails only the requests that ask for structure."""
    try:
        return make(GuidedSpec)
    except ImportError as e:
        raise APIError(400, f"structured output is unavailable on this server: {e}", param=prefix or None) from None
    except RequestError as e:   # GrammarError is a RequestError
        name = e.field if not prefix or e.field.startswith(prefix) else f"{prefix}.{e.field}"
        raise bad(name, e.message) from None


def _params(req: Any, prompts: list[list[int]], max_tokens: int | None, field: str, logprobs: int | None,
            max_model_len: int, prompt_field: str) -> tuple[SamplingParams, ...]:
    longest = max(map(len, prompts))
    if longest >= max_model_len:
        raise bad(prompt_field, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{longest}", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_model_len - longest
    elif longest + max_tokens > max_model_len:
        raise bad(field, f"This model's maximum context length is {max_model_len} tokens; you asked for "
                         f"{longest} prompt + {max_tokens} output tokens", code="context_length_exceeded")
    procs = (LogitBias(req.logit_bias),) if req.logit_bias else ()
    try:
        base = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0, logprobs=logprobs, ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()), logits_processors=procs, speculative=req.speculative)
    except RequestError as e:
        rename = {"max_tokens": field, "logprobs": "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"}
        raise bad(rename.get(e.field, e.field), e.message) from None
    # choice i of a seeded request draws with seed + i: reproducible, yet the n choices differ
    return tuple(dataclasses.replace(base, seed=None if req.seed is None else req.seed + i)
                 for _ in prompts for i in range(req.n))


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's logit_bias as a logits processor (token id -> bias added to its logit)."""
    bias: dict[str, float]

    def __call__(self, _ids: list[int], logits):
        for tok, b in self.bias.items():
            if int(tok) < logits.shape[-1]:
                logits[..., int(tok)] += b
        return logits
