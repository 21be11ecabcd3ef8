"""`run`: one prompt through a fresh engine, as `k3trt run` does (`--json` prints its result).

    run(engine_dir, "Reply in JSON:", speculative="ngram", json_schema={"type": "object", ...})
    -> {"text", "token_ids", "prompt_token_ids", "finish_reason", "error",
        "stats": {request stats (tokens/s, drafted / accepted tokens, acceptance rate, mean accepted
                  length, accepted-length histogram), "capacity_hits", "steps",
                  "speculative": the engine's acceptance counters, "device", "backend"}}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from k3trt.runtime.chat import chat_prompt
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.xtml import reasoning_open


def run(engine_dir: str | Path, prompt: str, *, chat: bool = False, max_tokens: int = 64,
        temperature: float = 0.0, seed: int | None = None, device: str = "cpu", speculative: str = "none",
        json_schema: dict | str | Path | None = None, regex: str | None = None, grammar: str | Path | None = None,
        images: list[Any] | None = None, **options: Any) -> dict[str, Any]:
    """One prompt through a fresh engine: what `k3trt run ... --json` prints (its `text` is what the
    plain `k3trt run` prints). `chat` wraps the prompt as one user message (K3 chat template, thinking
    on). At most one of `json_schema` (a schema, its JSON text or a file), `regex`, `grammar` (EBNF
    text or a file) constrains the output (JSON in its compact layout: a sampled model cannot pad it
    with whitespace forever); with `chat` the grammar starts after the reasoning. `images` (with `chat`): image
    parts before the prompt text, in order (paths, bytes or PIL images)."""
    given = {k: v for k, v in dict(json_schema=json_schema, regex=regex, grammar=grammar).items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one of --json-schema, --regex, --grammar; got {', '.join(given)}")
    if images and not chat:
        raise ValueError("--image needs --chat (the chat template places the image)")
    llm = LLM(engine_dir, device=device, speculative=speculative, **options)
    try:
        if chat:
            if llm.tokenizer is None:
                raise ValueError("--chat needs the engine's tokenizer; this engine dir has none")
            parts = [*({"type": "image", "image": im} for im in images or ()), {"type": "text", "text": prompt}]
            p = chat_prompt(llm.tokenizer, [{"role": "user", "content": parts}])
            prompt = {"prompt": p.ids, "images": p.images} if p.images else p.ids
        guided = None
        if given:
            (key, value), = given.items()
            if isinstance(value, os.PathLike):
                value = Path(value).read_text()
            # the prompt's own think state decides where the grammar starts (a chat prompt opens think)
            guided = {key: value, "chat": chat, "after_reasoning": chat or reasoning_open(prompt),
                      **({"max_whitespace": 0} if key == "json_schema" else {})}
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                    guided=guided))[0]
        engine = llm.stats()
    finally:
        llm.close()
    return {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "error": out.error,
            "stats": {**out.stats, "capacity_hits": engine["capacity_hits"], "steps": engine["steps"],
                      "speculative": engine["speculative"], "device": str(llm.session.device),
                      "backend": llm.engine_dir.backend}}
