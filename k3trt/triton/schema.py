"""The tensors of the k3trt Triton models, written once: the repository writer turns them into
config.pbtxt, the model reads requests and writes responses by the same names.

Every input is optional (a request brings `text_input` or `messages`) and carries one element
(dims [1]), except `stop`, which carries one string per stop sequence, and `images`, one encoded
image (PNG, JPEG, WebP, ... bytes) per element (both dims [-1]). Images go where a `text_input`
holds `<|media_pad|>`, one per image in order; with `messages` they open the last user message's
content, in order (an `image_url` data URL part in `messages` works as on the OpenAI server). There is no
Triton batch dimension (max_batch_size 0): k3trt batches in flight itself, so each request is
one prompt. STRING is Triton's BYTES (UTF-8 text); JSON-valued tensors hold JSON text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str            # Triton's config name without TYPE_ (STRING, INT32, INT64, FP32, BOOL)
    dims: tuple[int, ...] = (1,)
    doc: str = ""


INPUTS = (
    Tensor("text_input", "STRING", doc="a raw prompt (special-token strings are recognised)"),
    Tensor("messages", "STRING", doc="JSON list of chat messages (OpenAI shape); rendered with K3's chat template"),
    Tensor("tools", "STRING", doc="JSON list of OpenAI function tools (chat)"),
    Tensor("tool_choice", "STRING", doc="auto | none | required | a tool's name (chat)"),
    Tensor("thinking", "BOOL", doc="chat: open a think block (default true)"),
    Tensor("max_tokens", "INT32"),
    Tensor("stream", "BOOL", doc="true: one response per new piece of text, the last one flagged final"),
    Tensor("temperature", "FP32", doc="default 1.0; 0 is greedy"),
    Tensor("top_p", "FP32"),
    Tensor("top_k", "INT32"),
    Tensor("min_p", "FP32"),
    Tensor("repetition_penalty", "FP32"),
    Tensor("presence_penalty", "FP32"),
    Tensor("frequency_penalty", "FP32"),
    Tensor("seed", "INT64"),
    Tensor("stop", "STRING", (-1,), doc="stop strings, one per element"),
    Tensor("images", "STRING", (-1,), doc="encoded images, one per element (module doc: where they go)"),
    Tensor("guided_json", "STRING", doc="a JSON schema the output must match"),
    Tensor("guided_regex", "STRING", doc="a regular expression the output must match"),
    Tensor("speculative", "BOOL", doc="false: this request is never drafted for"),
)

OUTPUTS = (
    Tensor("text_output", "STRING", doc="the answer (content); a delta when streaming"),
    Tensor("reasoning_output", "STRING", doc="chat with thinking: the reasoning; a delta when streaming"),
    Tensor("tool_calls", "STRING", doc="final response: JSON list of OpenAI tool calls"),
    Tensor("finish_reason", "STRING", doc="final response: stop | length | tool_calls | abort"),
    Tensor("prompt_tokens", "INT32"),
    Tensor("completion_tokens", "INT32"),
    Tensor("drafted_tokens", "INT32", doc="speculative tokens verified"),
    Tensor("accepted_tokens", "INT32", doc="speculative tokens accepted"),
    Tensor("acceptance_rate", "FP32", doc="accepted / drafted (0 without drafts)"),
    Tensor("stats", "STRING", doc="final response: JSON of the request's runtime stats"),
)

INPUT_NAMES = frozenset(t.name for t in INPUTS)

# Error responses start with the kind of error. Triton 2.51 keeps no error code across BLS (the
# unary front receives every error as INTERNAL), so the front reads the kind back from this prefix.
# a request parameter: the engine model answers an empty non-final response once it has taken the request
ACK_PARAMETER = "k3trt_ack"
ERROR_PREFIX = {"INVALID_ARG": "invalid request: ", "UNAVAILABLE": "unavailable: ", "CANCELLED": "cancelled: ",
                "INTERNAL": "internal error: "}


def error_kind(message: str) -> str:
    return next((kind for kind, prefix in ERROR_PREFIX.items() if message.startswith(prefix)), "INTERNAL")
