"""From one request's fp32 logits to its next token: processors, penalties, temperature, top-k,
top-p, min-p, a draw from the request's own generator, and logprobs.

Order per row: logits processors → repetition / presence / frequency penalties → (logprobs are
taken here, over the full vocabulary) → temperature → top-k → top-p → min-p → renormalise → draw.
The draw is an exponential race (argmax p / E, E ~ Exp(1) from the request's torch.Generator), so a
seeded request draws the same tokens whatever else is in the batch, on the device of the logits.
``probs`` is exposed on its own: speculative acceptance needs the target distribution p.

Speculative verification gives one request 1 + len(drafts) rows; row j follows drafts[:j], so
``process`` shows row j's processors and penalties the committed tokens plus drafts[:j] as
generated, exactly what plain decoding would have seen at that position.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3trt.runtime.params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, token_ids: list[int],
                    num_prompt: int) -> torch.Tensor:
    """logits [R, V] fp32; every row gets the same penalties (they depend on the committed tokens)."""
    V = logits.shape[-1]
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.unique(torch.tensor(token_ids, device=logits.device).clamp_(0, V - 1))
        picked = logits[:, seen]
        r = params.repetition_penalty
        logits[:, seen] = torch.where(picked > 0, picked / r, picked * r)
    if (params.presence_penalty or params.frequency_penalty) and len(token_ids) > num_prompt:
        out = torch.tensor(token_ids[num_prompt:], device=logits.device).clamp_(0, V - 1)
        counts = torch.bincount(out, minlength=V).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: logits [R, V] -> probs [R, V] fp32."""
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop = (sp.cumsum(-1) - sp) >= params.top_p
        p = p.scatter(-1, idx, sp.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        p = p.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), 0.0)
    return p / p.sum(-1, keepdim=True)


def draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of p [R, V] (exact: P(token i) = p_i)."""
    e = torch.empty_like(p).exponential_(1.0, generator=generator)
    return (p / e).argmax(-1)


def choose(x: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The token of each processed row x [R, V]: the argmax, or a draw from the request's generator.
    The one expression every path uses (synchronous, one step ahead), so they draw alike."""
    return x.argmax(-1) if params.greedy else draw(probs(x, params), generator)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[dict[int, float]]:
    """Per row: the chosen token's logprob and the n most likely tokens' (log_softmax of logits)."""
    lp = torch.log_softmax(logits, dim=-1)
    out = []
    for r in range(lp.shape[0]):
        d = {int(tokens[r]): float(lp[r, tokens[r]])}
        if n:
            vals, ids = torch.topk(lp[r], n)
            d.update({int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist())})
        out.append(d)
    return out


def process(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int,
            drafts: Sequence[int] = ()) -> torch.Tensor:
    """One request's rows logits [R, V] (row j after drafts[:j]; R <= 1 + len(drafts)) -> a processed
    fp32 copy: logits processors, then penalties. A processor or penalty that raises fails only
    this request (the caller catches)."""
    x = logits.float().clone()
    penalised = (params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty)
    if not params.logits_processors and not penalised:
        return x
    drafts = list(drafts)
    for j in range(x.shape[0]):
        for proc in params.logits_processors:
            x[j] = proc(list(token_ids[num_prompt:]) + drafts[:j], x[j]).reshape(x.shape[-1]).float()
        if penalised:
            apply_penalties(x[j:j + 1], params, list(token_ids) + drafts[:j] if j else token_ids, num_prompt)
    return x


def sample(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int,
           generator: torch.Generator | None) -> tuple[list[int], list[dict[int, float]] | None]:
    """Tokens for one request's single row logits [1, V] (speculative rows go through ``process``
    and acceptance). Processors see the request's generated ids; a processor or penalty that raises
    fails only this request."""
    x = process(logits, params, token_ids, num_prompt)
    tokens = choose(x, params, generator)
    lps = top_logprobs(x, tokens, params.logprobs) if params.logprobs is not None else None
    return tokens.tolist(), lps


def greedy(logits: torch.Tensor) -> list[int]:
    """The batched fast path for rows whose params are `plain` (argmax only)."""
    return logits.argmax(-1).tolist()
