"""The scheduler's encoder budget on fake requests (no model): a chunk takes an image's tokens from
the step's budget or ends before the image, an image is encoded once, and a request that waits for
the budget preempts nobody."""

from __future__ import annotations

import dataclasses

import torch
from test_runtime_scheduler import fake_step, make, req

from k3trt.runtime.media import ImageInput


def with_images(r, *spans):
    r.images = tuple(ImageInput(torch.zeros(1), torch.tensor([1, 1, 1]), bytes([i]) * 32, a, b - a)
                     for i, (a, b) in enumerate(spans))
    return r


def encoded(plan):
    return [(r.request_id, i) for r, i in plan.encodes]


def test_the_encoder_budget_cuts_chunks_and_waits_without_preempting():
    s = make(max_num_tokens=64, prefill=(1, 16, 32, 64))
    s.config = dataclasses.replace(s.config, max_encoder_tokens=16)
    r1 = with_images(req(48), (16, 32), (32, 40))
    r2 = with_images(req(40, start=100), (16, 32))
    r3 = req(20, start=200)
    for r in (r1, r2, r3):
        s.add(r)
    p = fake_step(s)          # r1 stops before its second image (no budget left), r2 before its first
    assert [(c.req, c.start, c.num_tokens) for c in p.prefills] == [(r1, 0, 32), (r2, 0, 16), (r3, 0, 16)]
    assert encoded(p) == [(r1.request_id, 0)] and p.encoder_tokens == 16
    for r, i in p.encodes:
        r.image_embeds[i] = torch.zeros(r.images[i].num_tokens, 1)
    r1.image_embeds.pop(0)                 # its prefill passed it (the loop's release_passed)
    p = fake_step(s)          # r1's second image takes 8; r2's image (16) waits; r3 is not preempted
    assert not p.preempted and encoded(p) == [(r1.request_id, 1)]
    assert [(c.req, c.start) for c in p.prefills] == [(r1, 32), (r3, 16)]
    p = fake_step(s)
    assert encoded(p) == [(r2.request_id, 0)] and [(c.req, c.start) for c in p.prefills][-1] == (r2, 16)
