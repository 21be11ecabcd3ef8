"""OpenAI request models, their validation, and OpenAI's error shape.

Every refusal is an `APIError` whose JSON is `{"error": {"message", "type", "param", "code"}}`,
with `param` naming the offending field the way a client wrote it (`messages[2].content`,
`tools[0].function.name`). Unknown top-level fields are refused, as OpenAI's API does, so a typo
(`max_token`) fails loudly instead of being ignored. Numbers are strict (`"1"` is not an integer).
Fields whose type is a union (stop, prompt, tool_choice, messages) are checked by hand here, so the
error names the field and not a pydantic union branch.

Before any of that, one walk over the parsed body (`check_body`) refuses what would otherwise fail
deep inside the server as a 500: nesting past MAX_DEPTH (the template renderer, pydantic and the
grammar compiler all recurse), strings that are not valid Unicode (lone surrogates: the tokenizer
cannot encode them), integers outside int64 (torch cannot seed with them), and prompt text past the
server's character bound (counted before anything is tokenized).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 16
MAX_LOGPROBS = 20          # as the runtime's SamplingParams allows
MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_DEPTH = 64             # JSON nesting of a body; far below Python's recursion limit
INT64 = (-(1 << 63), (1 << 63) - 1)
PROMPT_FIELDS = ("messages", "tools", "prompt")     # whose text counts against the character bound
DEFAULT_MAX_PROMPT_CHARS = 1_000_000


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def __reduce__(self):       # raised in a prompt worker process: crosses back whole
        return _api_error, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _api_error(status: int, message: str, type: str, param: str | None, code: str | None,
               headers: dict) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of(loc: tuple) -> str:
    """('tools', 0, 'function', 'name') -> 'tools[0].function.name'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Model):
    """Fields both endpoints share (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids are
    vLLM-style extensions a client passes through `extra_body`; so is `speculative`: false keeps the
    request out of the server's speculative decoding, a no-op on a server that does not speculate)."""
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    speculative: bool = True
    response_format: ResponseFormat | None = None
    user: str | None = None          # accepted and ignored, as OpenAI's own fields
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatRequest(_Sampling):
    messages: list[Any]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"null")
    except ValueError as e:
        raise bad(None, f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad(None, f"The request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise bad(None, "The request body must be a JSON object")
    return data


def check_body(data: Any, max_prompt_chars: int | None = None) -> None:
    """Refuse nesting past MAX_DEPTH, lone surrogates, integers outside int64 and more than
    `max_prompt_chars` characters of text under PROMPT_FIELDS; iterative, so depth cannot hurt it."""
    chars = 0
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, loc, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(param_of(loc[:1]) or None, f"The request nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                _text_ok(k, loc)
                stack.append((v, (*loc, k), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, (*loc, i), depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _text_ok(value, loc)
            if loc[:1] and loc[0] in PROMPT_FIELDS and "image_url" not in loc:    # images: the byte limit
                chars += len(value)
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            raise bad(param_of(loc), f"Invalid value for '{param_of(loc)}': {value} is outside the 64-bit "
                                     f"integer range")
    if max_prompt_chars is not None and chars > max_prompt_chars:
        field = next((f for f in PROMPT_FIELDS if f in data), None) if isinstance(data, dict) else None
        raise bad(field, f"The prompt has {chars} characters; this server takes at most {max_prompt_chars}",
                  code="prompt_too_long")


def _text_ok(text: str, loc: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param_of(loc) or None, f"'{param_of(loc)}' is not valid Unicode: it holds a lone "
                                         f"surrogate") from None


def validate(model: type[_Model], data: dict[str, Any], max_prompt_chars: int | None = None) -> Any:
    check_body(data, max_prompt_chars)
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = param_of(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad(param, f"Unrecognized request argument supplied: {param}") from None
        if err["type"] == "missing":
            raise bad(param, f"Missing required parameter: '{param}'") from None
        raise bad(param, f"Invalid value for '{param}': {err['msg']}") from None
    req.stop = _stops(req.stop)
    if req.logit_bias:
        for key, value in req.logit_bias.items():
            if not key.isdigit() or not -100 <= value <= 100:
                raise bad(f"logit_bias.{key}", "logit_bias maps token ids (as strings) to biases in [-100, 100]")
    if isinstance(req, ChatRequest):
        _check_messages(req.messages)
        _check_tool_choice(req.tool_choice)
    else:
        _check_prompt(req.prompt)
        if req.best_of not in (None, req.n):
            raise bad("best_of", "best_of is not supported (it must be omitted or equal n)")
        if req.suffix:
            raise bad("suffix", "suffix is not supported")
    return req


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"stop may hold at most {MAX_STOP} strings")
    return tuple(stops)


def _check_tool_choice(choice: Any) -> None:
    if choice is None or choice in ("none", "auto", "required"):
        return
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def _check_prompt(prompt: Any) -> None:
    def ok(p: Any) -> bool:
        return (isinstance(p, str) and p != "") or (
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p))
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    if not (ok(prompt) or (many and all(ok(p) for p in prompt))):
        raise bad("prompt", "prompt must be a non-empty string, a list of token ids, or a list of those")


def _part_ok(p: Any) -> bool:
    if not isinstance(p, dict):
        return False
    if p.get("type") == "image_url":
        ref = p.get("image_url")
        return isinstance(ref, dict) and isinstance(ref.get("url"), str) and ref["url"] != ""
    return p.get("type", "text") == "text" and isinstance(p.get("text"), str)


def _content_ok(content: Any) -> bool:
    return isinstance(content, str) or isinstance(content, list) and all(map(_part_ok, content))


def _check_messages(messages: list[Any]) -> None:
    if not messages:
        raise bad("messages", "messages must hold at least one message")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(at, f"{at} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{at}.role", f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if not (_content_ok(content) or (content is None and role == "assistant")):
            raise bad(f"{at}.content", f"{at}.content must be a string or a list of text and image_url parts "
                                       "(image_url.url a data: URL)")
        for key in ("name", "reasoning_content", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise bad(f"{at}.{key}", f"{at}.{key} must be a string")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{at}.tool_calls", "tool_calls must be a list, on assistant messages only")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                        fn.get("arguments", "{}"), (str, dict)):
                    raise bad(f"{at}.tool_calls[{j}]", "a tool call needs function.name and function.arguments")
