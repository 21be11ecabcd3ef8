"""OpenAI response objects: chat completions and completions, whole and as stream chunks, with usage
and logprobs in OpenAI's layouts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from k3trt.runtime.xtml import Delta, DeltaKind
from k3trt.serve.output import ChoiceStream, Update, new_call_id


@dataclass
class Envelope:
    """What every object of one response shares."""
    id: str
    model: str
    created: int
    chat: bool
    tokenizer: Any
    top_logprobs: int | None = None
    call_ids: dict[tuple[int, int], str] = field(default_factory=dict)   # streamed: (choice, call) -> id

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def head(self, choices: list[dict], obj: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": obj or self.object, "created": self.created, "model": self.model,
                "choices": choices}

    # ---- logprobs -----------------------------------------------------------------------------
    def _tok(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def _top(self, lps: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lps.items(), key=lambda kv: -kv[1])[:self.top_logprobs or 0]

    def chat_logprobs(self, entries: list[tuple[int, dict[int, float]]]) -> dict | None:
        if self.top_logprobs is None:
            return None
        def one(t: int, lp: float) -> dict:
            return {"token": self._tok(t), "logprob": lp, "bytes": list(self.tokenizer.id_to_bytes(t))}
        return {"content": [{**one(t, lps[t]), "top_logprobs": [one(a, b) for a, b in self._top(lps)]}
                            for t, lps in entries], "refusal": None}

    def completion_logprobs(self, entries: list[tuple[int, dict[int, float]]], offset: int) -> dict | None:
        if self.top_logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lps in entries:
            text = self._tok(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lps[t])
            out["top_logprobs"].append({self._tok(a): b for a, b in self._top(lps)})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    # ---- streaming ------------------------------------------------------------------------------
    def chunks(self, cs: ChoiceStream, upd: Update, offset: int = 0) -> list[dict]:
        """Stream chunks for one update of one choice; logprobs ride on the first of them."""
        if self.chat:
            bodies = [self._delta(cs.index, d) for d in upd.deltas]
        else:
            bodies = [{"text": "".join(d.text for d in upd.deltas)}] if upd.deltas else []
        if not bodies and (upd.logprobs and self.top_logprobs is not None or upd.finished):
            bodies = [{} if self.chat else {"text": ""}]
        out = []
        for k, body in enumerate(bodies):
            choice: dict[str, Any] = {"index": cs.index, "finish_reason": None, "logprobs": None}
            choice["delta" if self.chat else "text"] = body if self.chat else body["text"]
            if k == 0 and upd.logprobs:
                choice["logprobs"] = (self.chat_logprobs(upd.logprobs) if self.chat
                                      else self.completion_logprobs(upd.logprobs, offset))
            out.append(self.head([choice], "chat.completion.chunk" if self.chat else None))
        if upd.finished:
            out[-1]["choices"][0]["finish_reason"] = cs.final_reason()
        return out

    def _delta(self, index: int, d: Delta) -> dict[str, Any]:
        if d.kind is DeltaKind.REASONING:
            return {"reasoning_content": d.text}
        if d.kind is DeltaKind.CONTENT:
            return {"content": d.text}
        if d.kind is DeltaKind.TOOL_NAME:
            call_id = self.call_ids.setdefault((index, d.index), new_call_id())
            return {"tool_calls": [{"index": d.index, "id": call_id, "type": "function",
                                    "function": {"name": d.text, "arguments": ""}}]}
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}

    def role_chunk(self, index: int) -> dict:
        return self.head([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}], "chat.completion.chunk")

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.head([], "chat.completion.chunk" if self.chat else None), "usage": usage}

    # ---- whole ----------------------------------------------------------------------------------
    def whole(self, streams: list[ChoiceStream], logprobs: dict[int, list], usage: dict,
              echo: dict[int, str] | None = None) -> dict[str, Any]:
        choices = []
        for cs in streams:
            if self.chat:
                choice = {"index": cs.index, "message": cs.message({}),
                          "logprobs": self.chat_logprobs(logprobs[cs.index]), "finish_reason": cs.final_reason()}
            else:
                prefix = (echo or {}).get(cs.index, "")
                choice = {"index": cs.index, "text": prefix + "".join(cs.content), "finish_reason": cs.final_reason(),
                          "logprobs": self.completion_logprobs(logprobs[cs.index], len(prefix))}
            choices.append(choice)
        return {**self.head(choices), "usage": usage}


def usage(prompt_tokens: int, streams: list[ChoiceStream]) -> dict[str, int]:
    completion = sum(len(cs.token_ids) for cs in streams)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()
