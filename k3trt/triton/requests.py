"""From a Triton request's input tensors to what the engine runs (the OpenAI server's Submission).

The tensors are turned into the body of an OpenAI chat (`messages`) or completion (`text_input`)
request and go through the server's own validation and planning (serve.protocol, serve.adapt),
so both front ends refuse the same requests with the same messages; only the field names are
translated back to the Triton inputs' names. `guided_json` travels as a json_schema
response_format; `guided_regex`, which OpenAI has no field for, travels as a json_object one whose
GuidedSpec (chat form, reasoning gate and all, as the server decides them) then swaps JSON for the
regex.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from k3trt.runtime.params import RequestError
from k3trt.runtime.structured import GuidedSpec
from k3trt.serve.adapt import Submission, chat_submission, completion_submission
from k3trt.serve.protocol import MAX_DEPTH, APIError, ChatRequest, CompletionRequest, bad, validate

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "speculative")
CHAT_ONLY = ("tools", "tool_choice", "thinking")
PROMPT_INPUTS = ("text_input", "messages", "tools")
RENAME = {"prompt": "text_input", "chat_template_kwargs": "thinking", "max_completion_tokens": "max_tokens"}


@dataclass(frozen=True)
class Job:
    submission: Submission            # .guided: one GuidedSpec per prompt (one prompt), or None
    stream: bool


@dataclass(frozen=True)
class Checked:
    """A request read and validated, not yet rendered or tokenized (what may run in a worker process)."""
    request: Any                      # ChatRequest or CompletionRequest
    chat: bool
    regex: str | None                 # guided_regex: swapped in for the json_object placeholder
    stream: bool
    images: tuple[bytes, ...] = ()    # text_input's images (one <|media_pad|> each); chat's are in its messages


def parse(raw: Mapping[str, np.ndarray], tokenizer: Any, *, model: str, max_model_len: int, vocab_size: int,
          json_max_whitespace: int | None = None, max_prompt_chars: int | None = None) -> Job:
    """A Job for the tensors `raw` (input name -> array); APIError (400, naming the input) if refused."""
    return plan(check(raw, model=model, max_prompt_chars=max_prompt_chars), tokenizer, max_model_len=max_model_len,
                vocab_size=vocab_size, json_max_whitespace=json_max_whitespace)


def prompt_bytes(raw: Mapping[str, np.ndarray]) -> int:
    """Bytes of the inputs a prompt is rendered from: a bound on its characters, known before decoding."""
    return sum(int(getattr(raw[k], "nbytes", 0)) if raw[k].dtype != object else
               sum(len(v) for v in raw[k].reshape(-1) if isinstance(v, (bytes, str)))
               for k in PROMPT_INPUTS if k in raw)


def check(raw: Mapping[str, np.ndarray], *, model: str, max_prompt_chars: int | None = None) -> Checked:
    """Everything `parse` refuses before rendering the prompt: cheap (JSON decoding and the schema),
    also for a maximal prompt; APIError (400, naming the input) if refused."""
    one = _Reader(raw)
    text, messages = one("text_input"), one("messages")
    if (text is None) == (messages is None):
        raise bad("text_input", "give exactly one of text_input and messages")
    body: dict[str, Any] = {"model": model, **{k: v for k in SAMPLING if (v := one(k)) is not None}}
    stops = [_text(s, "stop") for s in raw["stop"].reshape(-1)] if "stop" in raw else []
    if stops:
        body["stop"] = stops
    schema, regex = one("guided_json"), one("guided_regex")
    images = tuple(_bytes(v) for v in raw["images"].reshape(-1)) if "images" in raw else ()
    if schema is not None and regex is not None:
        raise bad("guided_regex", "give at most one of guided_json and guided_regex")
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "guided_json", "schema": _json(schema, "guided_json")}}
    elif regex is not None:
        body["response_format"] = {"type": "json_object"}      # a placeholder: swapped for the regex in `plan`
    try:
        if messages is not None:
            body["messages"] = _with_image_parts(_json(messages, "messages"), images)
            if (tools := one("tools")) is not None:
                body["tools"] = _json(tools, "tools")
            if (choice := one("tool_choice")) is not None:
                body["tool_choice"] = choice if choice in ("auto", "none", "required") else \
                    {"type": "function", "function": {"name": choice}}
            if (thinking := one("thinking")) is not None:
                body["chat_template_kwargs"] = {"thinking": thinking}
            return Checked(validate(ChatRequest, body, max_prompt_chars), True, regex, bool(one("stream")))
        given = [k for k in CHAT_ONLY if k in raw]
        if given:
            raise bad(given[0], f"{given[0]} needs messages (chat), not text_input")
        return Checked(validate(CompletionRequest, {**body, "prompt": text}, max_prompt_chars), False, regex,
                       bool(one("stream")), images)
    except APIError as e:
        raise _renamed(e, "guided_json" if regex is None else "guided_regex") from None


def plan(checked: Checked, tokenizer: Any, *, max_model_len: int, vocab_size: int,
         json_max_whitespace: int | None = None) -> Job:
    """Render and tokenize a checked request (the slow part: a worker process runs it for a large
    prompt); APIError (400, naming the input) if refused."""
    try:
        if checked.chat:
            sub = chat_submission(checked.request, tokenizer, max_model_len=max_model_len,
                                  json_max_whitespace=json_max_whitespace)
        else:
            sub = completion_submission(checked.request, tokenizer, vocab_size=vocab_size,
                                        max_model_len=max_model_len, json_max_whitespace=json_max_whitespace)
    except APIError as e:
        raise _renamed(e, "guided_json" if checked.regex is None else "guided_regex") from None
    if checked.regex is not None:
        sub = dataclasses.replace(sub, guided=tuple(_with_regex(spec, checked.regex) for spec in sub.guided))
    if checked.images:
        sub = dataclasses.replace(sub, images=checked.images)
    return Job(sub, checked.stream)


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _with_image_parts(messages: Any, images: tuple[bytes, ...]) -> Any:
    """The messages with `images` (as data URL parts) opening the last user message's content."""
    if not images:
        return messages
    last = next((i for i in range(len(messages) - 1, -1, -1) if isinstance(messages, list)
                 and isinstance(messages[i], dict) and messages[i].get("role") == "user"), None)
    if last is None:
        raise bad("images", "images need a user message in messages to open")
    content = messages[last].get("content")
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    parts = [{"type": "image_url", "image_url": {"url": "data:image;base64," + base64.b64encode(b).decode()}}
             for b in images]
    return [*messages[:last], {**messages[last], "content": parts + text}, *messages[last + 1:]]


class _Reader:
    """One element of an input, as a Python value (None when the input is absent)."""

    def __init__(self, raw: Mapping[str, np.ndarray]):
        self.raw = raw

    def __call__(self, name: str) -> Any:
        arr = self.raw.get(name)
        if arr is None:
            return None
        if arr.size != 1:
            raise bad(name, f"{name} must hold exactly one element, got shape {list(arr.shape)}")
        value = arr.reshape(-1)[0]
        return _text(value, name) if isinstance(value, (bytes, str)) else value.item()


def _text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(name, f"{name} is not valid UTF-8: {e}") from None


def _json(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise bad(name, f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise bad(name, f"{name} nests deeper than {MAX_DEPTH} levels") from None


def _renamed(e: APIError, guided: str) -> APIError:
    """The server's error with its field named as the Triton input (response_format -> `guided`)."""
    names = {**RENAME, "response_format": guided}
    head = (e.param or "").split(".")[0].split("[")[0]
    if head in names:
        e.param = names[head]
        e.message = e.message.replace("response_format", guided).replace("chat_template_kwargs.", "")
    return e


def _with_regex(spec: GuidedSpec, regex: str) -> GuidedSpec:
    if not isinstance(regex, str) or not regex:
        raise bad("guided_regex", "guided_regex must be a non-empty string")
    try:
        return dataclasses.replace(spec, json_object=False, regex=regex)    # checked again: a bad regex fails
    except RequestError as e:                                             # (GrammarError is a RequestError)
        raise bad("guided_regex", e.message) from None
