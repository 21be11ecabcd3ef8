"""Helpers for the runtime tests: engine dirs from the tiny checkpoint, a cache of LLMs, the
full-recompute greedy oracle, and the leak check every runtime test ends with."""

from __future__ import annotations

import base64
import contextlib
import io
import time

import torch
from PIL import Image

from k3trt.builder.build import build_engine
from k3trt.model.context import ModelCache, StepContext
from k3trt.runtime.params import SamplingParams

BLOCK = 16


def reference_greedy(model, cfg, prompt: list[int], n: int, embeds=None) -> list[int]:
    """Greedy tokens by full recompute: a fresh cache and the whole sequence at every step.
    embeds: (rows, values) replacing prompt rows' embeddings (images)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            T = len(ids)
            nb = -(-T // BLOCK)
            cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=BLOCK, num_slots=1,
                                        layers=range(cfg.num_hidden_layers))
            ctx = StepContext((T,), (0,), torch.arange(T), torch.arange(nb, dtype=torch.int32)[None],
                              torch.tensor([0]))
            hidden = model(torch.tensor(ids), ctx, cache, embeds=embeds)
            ids.append(int(model.logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]


def assert_no_leak(llm) -> None:
    """Every block and KDA slot is free again and no request is left."""
    assert not llm.has_unfinished(), f"requests left: {list(llm.loop.requests)}"
    usage = llm.cache.usage()
    assert usage["blocks_in_use"] == 0 and usage["slots_in_use"] == 0, usage
    assert llm.cache.pool.num_free == llm.cache.pool.num_blocks, usage
    assert not llm.scheduler.running and not llm.scheduler.waiting


def assert_idle_and_no_leak(llm, timeout: float = 10.0) -> None:
    """A served engine whose requests have all ended holds no block, slot or request: wait (up to
    `timeout`) for its loop to finish what the server handed it, then assert_no_leak."""
    deadline = time.monotonic() + timeout
    while llm.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_no_leak(llm)


def assert_released(llm) -> None:
    """assert_no_leak, and the drafter holds nothing for any request (speculative decoding)."""
    assert_no_leak(llm)
    d = llm.spec.drafter
    for name in ("seqs", "_index"):
        assert not getattr(d, name, None), f"drafter {d.name} still holds {name}: {getattr(d, name)}"
    if hasattr(d, "free_slots"):      # a draft model: every slot and cache block back
        assert len(d.free_slots) == llm.config.max_batch
        assert len(d.blocks.free) == next(iter(d.cache.mla.values())).shape[0]


def arrival_and_abort_while_ahead(llm, ps: list[list[int]], want: list[list[int]], max_tokens: list[int],
                                  warm_steps: int) -> None:
    """Requests 0 and 3 run `warm_steps` steps, until a step is launched ahead of the host's commit;
    then request 2 arrives and 3 is aborted while the launched step holds its rows: 0 and 2 give
    `want`, 3 ends as an abort, and nothing leaks."""
    ids, done = {}, {}

    def collect(outs):
        done.update({ids[o.request_id]: o for o in outs if o.finished})

    ids[llm.add_request(ps[0], SamplingParams(max_tokens=max_tokens[0]))] = 0
    ids[victim := llm.add_request(ps[3], SamplingParams(max_tokens=max_tokens[3]))] = 3
    for _ in range(warm_steps):
        collect(llm.step())
    assert llm.loop.lookahead.launched is not None       # a step launched on the device's verdict
    ids[llm.add_request(ps[2], SamplingParams(max_tokens=max_tokens[2]))] = 2   # arrives mid-flight
    llm.abort(victim)                                    # ends while the launched step holds its rows
    while llm.has_unfinished():
        collect(llm.step())
    assert done[0].token_ids == want[0] and done[2].token_ids == want[2]
    assert done[3].finish_reason == "abort"
    assert llm.stats()["launched_ahead"] > 0
    assert_released(llm)


def prompts(seed: int, lengths: list[int], vocab: int = 120000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def build_tiny_engine(ckpt, out, **kw):
    """The runtime tests' engine: fp32, verify capacities 1/2/4, 32 tokens per step, blocks of 16."""
    args = dict(dtype="fp32", capacities=[1, 2, 4], max_num_tokens=32, spec_tokens=0, block_size=BLOCK)
    return build_engine(ckpt, out, **{**args, **kw})


class Oracle:
    """reference_greedy, memoised: several tests ask for the same prompts."""

    def __init__(self, model, cfg):
        self.model, self.cfg, self.memo = model, cfg, {}

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        have = self.memo.get(key, [])
        if len(have) < n:
            have = have + reference_greedy(self.model, self.cfg, list(prompt) + have, n - len(have))
            self.memo[key] = have
        return have[:n]


@contextlib.contextmanager
def one_thread():
    """Tiny-model steps are a few ms: intra-op threads only add sync cost, and on a busy 2-core CI
    machine they turn seconds into minutes. Restores the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def png(seed: int, width: int = 56, height: int = 56) -> bytes:
    """A random RGB PNG (test input)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()
