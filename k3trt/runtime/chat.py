"""The K3 chat template as Python: the renderer the runtime uses (its Jinja equivalent,
`CHAT_TEMPLATE`, and the rendering of a checkpoint's own template are runtime/chat_jinja.py's;
both are importable from here).

Format (Kimi K3's public `encoding_k3.py`, as read in public serving code; see spec/XTML.md):
every element is `<|open|>NAME attrs<|sep|> … <|close|>NAME<|sep|>`, a message is
`<|open|>message role="R" …<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`:
- tools (if any) first, as a system message `type="tool-declare"` holding their JSON schema;
- system / developer (rendered as system) / user: the content as body;
- assistant: `think` (thinking on only; structural, possibly empty), `response`, then `tools` with
  one `call tool="NAME" index="i"` per tool call, each argument an `argument key="K" type="T"`
  element (strings raw, everything else JSON), or one `json type="object"` element when the
  arguments are a string that is not a JSON object;
- tool results: `message role="tool" tool="NAME" index="i"` (i counts results since the last
  assistant message; NAME from the message, else from that assistant's i-th call);
- generation prompt: `<|open|>message role="assistant"<|sep|>` then `<|open|>think<|sep|>` (thinking)
  or `<|open|>response<|sep|>`.
- an image content part (OpenAI `image_url`, or `image` with a PIL image / bytes / path) renders as
  Kimi K2.5's span `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`; `chat_prompt`
  gives the ids with one `<|media_pad|>` per image and the images in that order, and the runtime
  widens each pad to the image's token count (runtime/media.py).
Only `<|open|>`, `<|sep|>`, `<|close|>`, `<|end_of_msg|>` and the four media markers are special tokens; element names,
attributes and bodies are ordinary text. `render_ids` encodes every text part with special tokens
disallowed, so marker strings inside user or tool text stay plain text and cannot open a tool call.
The Jinja string cannot keep that distinction (Hugging Face tokenizes its output as one string):
use `render_ids` for untrusted text. The Jinja form also cannot parse JSON, so arguments given as a
JSON string render there as a `json` element; pass dicts where the two must agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from k3trt.runtime.chat_jinja import CHAT_TEMPLATE as CHAT_TEMPLATE  # re-exported
from k3trt.runtime.chat_jinja import Encoder, template_ids
from k3trt.runtime.xtml import CLOSE, END_OF_MSG, OPEN, SEP
from k3trt.runtime.xtml_values import escape_attr

# an image in the prompt (Kimi K2.5's markers); MEDIA_PAD is the model's media_placeholder_token_id
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"
IMAGE_SPAN = f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"
IMAGE_PART_TYPES = ("image_url", "image")
CONTROL_TOKENS = (OPEN, SEP, CLOSE, END_OF_MSG, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
TOOLS_FOOTER = "\n```"

# Argument type names by Python type; bool before int because bool is an int.
_ARG_TYPES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (bool, "boolean"), (type(None), "null"), ((int, float), "number"), (str, "string"),
    (dict, "object"), ((list, tuple), "array"),
)


@dataclass(frozen=True)
class ImagePart:
    source: Any     # what the caller gave: a URL string, bytes, a path or a PIL image


@dataclass(frozen=True)
class ChatPrompt:
    """A chat as the engine takes it: the ids hold one MEDIA_PAD per image (the runtime widens each
    to the image's token count, runtime/media.py); `images` are the image sources in that order."""
    ids: list[int]
    images: list[Any]


@dataclass(frozen=True)
class Segment:
    text: str
    control: bool  # True: one special token of the template; False: text, encoded without specials


class _Builder:
    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def control(self, token: str) -> None:
        self.segments.append(Segment(token, True))

    def text(self, text: str) -> None:
        if not text:
            return
        if self.segments and not self.segments[-1].control:  # one text run between markers
            text = self.segments.pop().text + text
        self.segments.append(Segment(text, False))

    def open(self, tag: str, **attrs: Any) -> None:
        self.control(OPEN)
        self.text(tag + "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs.items()))
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.control(END_OF_MSG)


def _parts(content: Any) -> list[str | ImagePart]:
    """A message's content as its text runs and image parts, in order."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, (list, tuple)):
        out: list[str | ImagePart] = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError(f"message content part must be an object, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind in IMAGE_PART_TYPES:
                out.append(ImagePart(image_source(part)))
            elif kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (text, image_url, image)")
            elif isinstance(part.get("text"), str):
                out.append(part["text"])
        return out
    raise ValueError(f"message content must be a string, a list of parts or null, got "
                     f"{type(content).__name__}")


def _body(b: _Builder, content: Any) -> None:
    for part in _parts(content):
        if isinstance(part, ImagePart):
            b.control(MEDIA_BEGIN)
            b.text("image")
            b.control(MEDIA_CONTENT)
            b.control(MEDIA_PAD)
            b.control(MEDIA_END)
        else:
            b.text(part)


def image_source(part: dict) -> Any:
    """The image of one content part: OpenAI's ``{"type": "image_url", "image_url": {"url": URL}}``
    (or the URL as a string) or ``{"type": "image", "image": PIL image | bytes | path}``."""
    if part.get("type") == "image":
        if part.get("image") is None:
            raise ValueError("an image content part needs `image` (a PIL image, bytes or a path)")
        return part["image"]
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url content part needs `image_url.url` (a data: URL or a file path)")
    return url


def image_sources(messages: Sequence[dict]) -> list[Any]:
    """Every image of the messages, in prompt order (the order the template renders them in)."""
    return [p.source for m in messages for p in _parts(m.get("content")) if isinstance(p, ImagePart)]


def _arg_type(value: Any) -> str:
    for types, name in _ARG_TYPES:
        if isinstance(value, types):
            return name
    raise ValueError(f"tool call argument of type {type(value).__name__} is not JSON")


def _arg_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _name(message: dict) -> dict[str, str]:
    name = message.get("name")
    return {"name": name} if isinstance(name, str) and name else {}


def _render_call(b: _Builder, position: int, call: dict) -> None:
    function = call.get("function", call)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call {position} has no function name")
    b.open("call", tool=name, index=position)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        else:
            b.open("json", type="object")
            b.text(arguments)
            b.close("json")
            arguments = None
    for key, value in (arguments or {}).items():
        b.open("argument", key=key, type=_arg_type(value))
        b.text(_arg_text(value))
        b.close("argument")
    b.close("call")


def _render_assistant(b: _Builder, message: dict, thinking: bool) -> None:
    b.open("message", role="assistant", **_name(message))
    if thinking:  # the think channel is structural: present even when empty
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        b.open("think")
        if isinstance(reasoning, str) and reasoning.strip():
            b.text(reasoning)
        b.close("think")
    b.open("response")
    _body(b, message.get("content"))
    b.close("response")
    calls = message.get("tool_calls") or []
    if calls:
        b.open("tools")
        for position, call in enumerate(calls, start=1):
            _render_call(b, position, call)
        b.close("tools")
    b.end_message()


def render_segments(messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                    thinking: bool = True, add_generation_prompt: bool = True) -> list[Segment]:
    """The prompt as control tokens and text runs (adjacent text merged)."""
    b = _Builder()
    if tools:
        b.open("message", role="system", type="tool-declare")
        b.text(TOOLS_HEADER + json.dumps(list(tools), ensure_ascii=False, sort_keys=True,
                                         separators=(",", ":")) + TOOLS_FOOTER)
        b.end_message()
    previous_calls: list = []
    tool_index = 0
    for position, message in enumerate(messages):
        role = message.get("role")
        if role in ("system", "developer", "user"):
            b.open("message", role="user" if role == "user" else "system", **_name(message))
            _body(b, message.get("content"))
            b.end_message()
        elif role == "assistant":
            previous_calls, tool_index = message.get("tool_calls") or [], 0
            _render_assistant(b, message, thinking)
        elif role == "tool":
            tool_index += 1
            name = message.get("tool") or message.get("name")
            if not name and tool_index <= len(previous_calls):
                call = previous_calls[tool_index - 1]
                name = call.get("function", call).get("name")
            if not name:
                raise ValueError(f"messages[{position}]: a tool message needs `name` or a "
                                 f"preceding assistant tool call")
            b.open("message", role="tool", tool=name, index=tool_index)
            _body(b, message.get("content"))
            b.end_message()
        else:
            raise ValueError(f"messages[{position}]: unsupported role {role!r}")
    if add_generation_prompt:
        b.open("message", role="assistant")
        b.open("think" if thinking else "response")
    return b.segments


def render(messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
           thinking: bool = True, add_generation_prompt: bool = True) -> str:
    """The prompt as one string (what `CHAT_TEMPLATE` renders)."""
    return "".join(s.text for s in render_segments(
        messages, tools=tools, thinking=thinking, add_generation_prompt=add_generation_prompt))


def render_ids(tokenizer: Encoder, messages: Sequence[dict], *,
               tools: Sequence[dict] | None = None, thinking: bool = True,
               add_generation_prompt: bool = True) -> list[int]:
    """The prompt as token ids: template markers are special ids, every text run is encoded with
    special tokens disallowed (so marker strings in user / tool text stay plain text)."""
    ids: list[int] = []
    for seg in render_segments(messages, tools=tools, thinking=thinking,
                               add_generation_prompt=add_generation_prompt):
        if seg.control:
            if seg.text not in tokenizer.special_ids:
                raise ValueError(f"tokenizer has no special token {seg.text!r}; it is not a K3 "
                                 f"tokenizer (make one with write_k3_tokenizer)")
            ids.append(tokenizer.special_ids[seg.text])
        else:
            ids.extend(tokenizer.encode(seg.text, allow_special=False))
    return ids


def chat_ids(tokenizer: Encoder, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
             thinking: bool = True, add_generation_prompt: bool = True) -> list[int]:
    """The prompt as token ids: through the checkpoint's own template when the tokenizer has one
    (`chat_template`), else the built-in K3 renderer (render_ids). An image part renders as
    IMAGE_SPAN with one MEDIA_PAD (chat_prompt also gives the images)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return template_ids(tokenizer, template, messages, tools=tools, thinking=thinking,
                            add_generation_prompt=add_generation_prompt)
    return render_ids(tokenizer, messages, tools=tools, thinking=thinking, add_generation_prompt=add_generation_prompt)


def chat_prompt(tokenizer: Encoder, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                thinking: bool = True, add_generation_prompt: bool = True) -> ChatPrompt:
    """chat_ids and the messages' images in prompt order; a ValueError if the template did not
    place exactly one MEDIA_PAD per image."""
    ids = chat_ids(tokenizer, messages, tools=tools, thinking=thinking, add_generation_prompt=add_generation_prompt)
    images = image_sources(messages)
    if images:
        pad = tokenizer.special_ids.get(MEDIA_PAD)
        placed = ids.count(pad) if pad is not None else 0
        if placed != len(images):
            raise ValueError(f"the chat template placed {placed} image placeholders ({MEDIA_PAD}) for "
                             f"{len(images)} images: this tokenizer or template does not take images")
    return ChatPrompt(ids, images)
