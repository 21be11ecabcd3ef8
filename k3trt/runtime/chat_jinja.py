"""Chat templates as Jinja: the K3 template as a Jinja string (``CHAT_TEMPLATE``, written into
tokenizer_config.json for Hugging Face users; equivalent to runtime/chat.py's renderer), and a
checkpoint's own Jinja template rendered in a sandbox into ids (``template_ids``), with special
tokens taken only from the template, never from the caller's text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, Sequence


class Encoder(Protocol):
    special_ids: dict[str, int]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...


# The same template for Hugging Face's apply_chat_template (its `tojson` takes json.dumps keyword
# arguments). Kwargs: tools, add_generation_prompt, thinking (or enable_thinking), default on.
# Every literal is a Jinja expression, so trim_blocks / lstrip_blocks cannot change the output.
_J_ATTR = '|string|replace("&", "&amp;")|replace(\'"\', "&quot;")'
CHAT_TEMPLATE = "".join([
    '{%- macro open(tag) -%}{{ "<|open|>" ~ tag ~ "<|sep|>" }}{%- endmacro -%}',
    '{%- macro close(tag) -%}{{ "<|close|>" ~ tag ~ "<|sep|>" }}{%- endmacro -%}',
    '{%- macro attr(k, v) -%}{{ " " ~ k ~ "=\\"" ~ (v', _J_ATTR, ') ~ "\\"" }}{%- endmacro -%}',
    '{%- macro name_attr(m) -%}{%- if m.name is defined and m.name is string and m.name -%}',
    '{{ attr("name", m.name) }}{%- endif -%}{%- endmacro -%}',
    '{%- macro end() -%}{{ close("message") ~ "<|end_of_msg|>" }}{%- endmacro -%}',
    '{%- macro body(c) -%}{%- if c is string -%}{{ c }}{%- elif c is iterable and c is not mapping -%}',
    '{%- for p in c -%}{%- if p.type is defined and p.type in ["image_url", "image"] -%}',
    '{{ "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" }}',
    '{%- elif p.text is defined and p.text is string -%}{{ p.text }}{%- endif -%}',
    '{%- endfor -%}{%- endif -%}{%- endmacro -%}',
    '{%- macro argtype(v) -%}{%- if v is boolean -%}boolean{%- elif v is none -%}null',
    '{%- elif v is number -%}number{%- elif v is string -%}string{%- elif v is mapping -%}object',
    '{%- else -%}array{%- endif -%}{%- endmacro -%}',
    '{%- if thinking is defined -%}{%- set think = thinking -%}',
    '{%- elif enable_thinking is defined -%}{%- set think = enable_thinking -%}',
    '{%- else -%}{%- set think = true -%}{%- endif -%}',
    '{%- if tools is defined and tools -%}',
    '{{ open("message" ~ attr("role", "system") ~ attr("type", "tool-declare")) }}',
    '{{ "# Tools\\nHere are the available tools, described in JSONSchema.\\n\\n```json\\n" }}',
    '{{ tools|tojson(separators=(",", ":"), sort_keys=true) }}{{ "\\n```" }}{{ end() }}',
    '{%- endif -%}',
    '{%- set ns = namespace(calls=[], tool_index=0) -%}',
    '{%- for m in messages -%}',
    '{%- if m.role in ["system", "developer", "user"] -%}',
    '{{ open("message" ~ attr("role", "user" if m.role == "user" else "system") ~ name_attr(m)) }}',
    '{{ body(m.content) }}{{ end() }}',
    '{%- elif m.role == "assistant" -%}',
    '{%- set ns.calls = m.tool_calls if m.tool_calls is defined and m.tool_calls else [] -%}',
    '{%- set ns.tool_index = 0 -%}',
    '{{ open("message" ~ attr("role", "assistant") ~ name_attr(m)) }}',
    '{%- if think -%}{{ open("think") }}',
    '{%- set r = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content ',
    'else (m.reasoning if m.reasoning is defined else none) -%}',
    '{%- if r is string and r|trim -%}{{ r }}{%- endif -%}{{ close("think") }}{%- endif -%}',
    '{{ open("response") }}{{ body(m.content) }}{{ close("response") }}',
    '{%- if ns.calls -%}{{ open("tools") }}',
    '{%- for c in ns.calls -%}{%- set f = c.function if c.function is defined else c -%}',
    '{{ open("call" ~ attr("tool", f.name) ~ attr("index", loop.index)) }}',
    '{%- if f.arguments is string -%}',
    '{{ open("json" ~ attr("type", "object")) }}{{ f.arguments }}{{ close("json") }}',
    '{%- elif f.arguments is mapping -%}{%- for k, v in f.arguments.items() -%}',
    '{{ open("argument" ~ attr("key", k) ~ attr("type", argtype(v))) }}',
    '{%- if v is string -%}{{ v }}{%- else -%}{{ v|tojson }}{%- endif -%}{{ close("argument") }}',
    '{%- endfor -%}{%- endif -%}{{ close("call") }}{%- endfor -%}{{ close("tools") }}{%- endif -%}',
    '{{ end() }}',
    '{%- elif m.role == "tool" -%}',
    '{%- set ns.tool_index = ns.tool_index + 1 -%}',
    '{%- if m.tool is defined and m.tool -%}{%- set tname = m.tool -%}',
    '{%- elif m.name is defined and m.name -%}{%- set tname = m.name -%}',
    '{%- else -%}{%- set c = ns.calls[ns.tool_index - 1] -%}',
    '{%- set tname = c.function.name if c.function is defined else c.name -%}{%- endif -%}',
    '{{ open("message" ~ attr("role", "tool") ~ attr("tool", tname) ~ attr("index", ns.tool_index)) }}',
    '{{ body(m.content) }}{{ end() }}',
    '{%- endif -%}',
    '{%- endfor -%}',
    '{%- if add_generation_prompt -%}',
    '{{ open("message" ~ attr("role", "assistant")) }}{{ open("think" if think else "response") }}',
    '{%- endif -%}',
])


# ---- a checkpoint's own Jinja template ------------------------------------------------------------
# Marker strings in the caller's text are swapped for these private-use sentinels while the template
# renders, so that every special token left in the output is the template's own.
_SENTINEL = "\ue000{}\ue001"


def _compile(template: str):
    """The template in a sandbox configured as transformers' apply_chat_template configures it (its
    `tojson` takes json.dumps keyword arguments; `raise_exception` raises ValueError)."""
    import jinja2.ext  # noqa: PLC0415 (optional: jinja2)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415 (optional: jinja2)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _shield(value: Any, markers: Sequence[str]) -> Any:
    """`value` with every marker string inside its strings (keys too) replaced by its sentinel."""
    if isinstance(value, str):
        if "\ue000" in value or "\ue001" in value:
            raise ValueError("chat text may not contain the private-use characters U+E000 / U+E001")
        for i, m in enumerate(markers):
            value = value.replace(m, _SENTINEL.format(i))
        return value
    if isinstance(value, dict):
        return {_shield(k, markers): _shield(v, markers) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shield(v, markers) for v in value]
    return value


def template_ids(tokenizer: Encoder, template: str, messages: Sequence[dict], *,
                 tools: Sequence[dict] | None = None, thinking: bool = True,
                 add_generation_prompt: bool = True) -> list[int]:
    """The prompt as token ids through a checkpoint's own Jinja chat template (tokenizer_config.json
    or chat_template.jinja), rendered in a sandbox. Special tokens come only from the template:
    marker strings in message or tool text are shielded while it renders and encoded as plain text."""
    markers = sorted(tokenizer.special_ids, key=len, reverse=True)
    text = _compile(template).render(
        messages=_shield(list(messages), markers), tools=_shield(tools, markers), thinking=thinking,
        enable_thinking=thinking, add_generation_prompt=add_generation_prompt)
    ids: list[int] = []
    pos = 0
    split = re.compile("|".join(re.escape(m) for m in markers)) if markers else None
    for m in split.finditer(text) if split else ():
        ids.extend(_plain(tokenizer, text[pos:m.start()], markers))
        ids.append(tokenizer.special_ids[m.group()])
        pos = m.end()
    ids.extend(_plain(tokenizer, text[pos:], markers))
    return ids


def _plain(tokenizer: Encoder, text: str, markers: Sequence[str]) -> list[int]:
    for i, m in enumerate(markers):
        text = text.replace(_SENTINEL.format(i), m)
    return tokenizer.encode(text, allow_special=False) if text else []
