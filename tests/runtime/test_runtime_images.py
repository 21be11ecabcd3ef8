"""Images through the runtime (tiny preset, with its MoonViT tower): greedy
output equals a full recompute with the image embeddings in their placeholders' rows, across
chunked prefill, encoder budgets, preemption and speculation; the prefix cache keys images by their
bytes; bad images are refused by name and release nothing they did not take."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from runtime_utils import data_url, png
from runtime_utils import assert_no_leak, assert_released, reference_greedy

from k3trt.cli import main
from k3trt.runtime.llm import LLM
from k3trt.runtime.media import ImageIntake, ImageLimits, MediaPrompt
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.testing import assert_close

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MEDIA_PAD_ID = 129287                 # <|media_pad|> in the K3 tokenizer
TEXT = "Look at this picture and describe what you see in it, please:"


def _llm(engine, **kw) -> LLM:
    return LLM(engine, verify_checksums=False, **kw)


def _reference(llm: LLM, prompt: MediaPrompt, n: int) -> list[int]:
    """Greedy tokens by full recompute, the encoder run on each image alone."""
    model, rows, values = llm.session.model, [], []
    for im in prompt.images:
        with torch.inference_mode():
            values.append(model.vision(im.pixel_values, im.grid_thw[None]))
        rows.append(torch.arange(im.offset, im.end))
    embeds = (torch.cat(rows), torch.cat(values)) if rows else None
    return reference_greedy(model, model.cfg, prompt.ids, n, embeds)


def _prompt(llm: LLM, text: str, images: list) -> MediaPrompt:
    return llm.images.prepare(llm.tokenizer.encode(text, allow_special=True), images)


@pytest.mark.parametrize("images, text", [
    ([png(1, 112, 112)], TEXT + " <|media_pad|>"),                        # 16 tokens across a chunk end
    ([png(1), png(2, 84, 56)], "<|media_pad|> versus <|media_pad|>: " + TEXT),
])
def test_image_prompts_equal_a_full_recompute(engine, vision, images, text):
    llm = _llm(engine)
    want = _reference(llm, _prompt(llm, text, images), GREEDY.max_tokens)
    outs = llm.generate([{"prompt": text, "images": images}] * 2, GREEDY)
    assert [o.token_ids for o in outs] == [want, want]
    assert_no_leak(llm)
    assert not any(llm.loop.requests)


def test_a_small_encoder_budget_spreads_images_over_steps(engine, vision):
    llm = _llm(engine, max_encoder_tokens=16)
    text = "<|media_pad|><|media_pad|> two pictures"
    images = [png(3, 112, 112), png(4, 112, 112)]               # 16 image tokens each
    want = _reference(llm, _prompt(llm, text, images), GREEDY.max_tokens)
    assert llm.generate({"prompt": text, "images": images}, GREEDY)[0].token_ids == want
    # two requests that each need the whole budget at once: one waits a step, nobody is preempted
    pair = [{"prompt": f"<|media_pad|> picture {i}", "images": [png(40 + i, 112, 112)]} for i in range(2)]
    outs = llm.generate(pair, GREEDY)
    assert [o.token_ids for o in outs] == [_reference(llm, _prompt(llm, p["prompt"], p["images"]), 6) for p in pair]
    assert llm.counters["preemptions"] == 0
    assert_no_leak(llm)
    with pytest.raises(RequestError, match="max_encoder_tokens"):
        _llm(engine, max_encoder_tokens=8).generate({"prompt": text, "images": images}, GREEDY)


def test_different_image_different_cache_keys_and_output(engine, vision):
    llm = _llm(engine)
    text = TEXT + " <|media_pad|> and more words after the picture to fill a block"
    a, b = (llm.loop.new_request({"prompt": text, "images": [png(s)]}, GREEDY, 0, None) for s in (5, 6))
    llm.cache._hash_upto(a, len(a.token_ids) // 16)
    llm.cache._hash_upto(b, len(b.token_ids) // 16)
    first = a.images[0].offset // 16                       # the first block holding a placeholder
    assert a.token_ids == b.token_ids
    assert a.block_hashes[:first] == b.block_hashes[:first]
    assert not set(a.block_hashes[first:]) & set(b.block_hashes[first:])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    out_a, again, other = (llm.generate({"prompt": text, "images": [png(s)]}, params)[0] for s in (5, 5, 6))
    assert again.token_ids == out_a.token_ids and again.stats["cached_tokens"] >= 16 * (first + 1)
    assert other.stats["cached_tokens"] <= 16 * first
    assert other.logprobs[0] != out_a.logprobs[0]         # another image, another distribution
    assert_no_leak(llm)


def test_preemption_and_abort_release_the_images(engine, vision):
    llm = _llm(engine, num_blocks=8, max_model_len=96, max_batch=4)
    prompts = [{"prompt": f"{i} " + TEXT + " <|media_pad|>", "images": [png(10 + i, 112, 112)]} for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.counters["preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == _reference(llm, _prompt(llm, p["prompt"], p["images"]), 24)
    rid = llm.add_request(prompts[0], params)
    llm.step()
    req = llm.loop.requests[rid]
    assert req.image_embeds or req.num_computed >= req.images[0].end
    llm.abort(rid)
    assert not req.image_embeds
    llm.step()
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_greedy_speculation_equals_greedy_on_an_image_prompt(engine, vision, method):
    p = {"prompt": TEXT + " <|media_pad|> " + TEXT, "images": [png(7, 112, 56)]}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _llm(engine).generate(p, params)[0].token_ids
    llm = _llm(engine, speculative=method, spec_tokens=2)
    assert llm.generate(p, params)[0].token_ids == want
    assert_released(llm)


def test_mtp_drafts_from_the_image_embeddings(engine, vision):
    """The MTP layer embeds prompt tokens itself: at image placeholders it takes the image rows the
    target read, not the placeholder's token embedding (K3's serving code feeds them the same way)."""
    p = {"prompt": TEXT + " <|media_pad|> and <|media_pad|> " + TEXT, "images": [png(7, 112, 56), png(8)]}
    llm = _llm(engine, speculative="mtp", spec_tokens=2)
    drafter, seen = llm.spec.drafter, []
    forward = drafter._forward

    def spy(ids, prev, ctx, embeds=None):
        if embeds is not None:
            seen.append((ids.clone(), embeds[0].clone(), embeds[1].clone()))
        return forward(ids, prev, ctx, embeds)

    drafter._forward = spy
    out = llm.generate(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    prompt = _prompt(llm, p["prompt"], p["images"])
    assert len(seen) == 1 and drafter.stats()["image_rows"] == sum(im.num_tokens for im in prompt.images)
    ids, rows, values = seen[0]
    assert ids.tolist() == prompt.ids[1:] + out.token_ids[:1]     # step 0: the tokens after position 0
    assert rows.tolist() == [q - 1 for im in prompt.images for q in range(im.offset, im.end)]
    with torch.inference_mode():
        want = torch.cat([llm.session.model.vision(im.pixel_values, im.grid_thw[None]) for im in prompt.images])
    assert_close(values, want, dtype=torch.float32)
    assert_released(llm)


def test_json_schema_with_an_image(engine, vision):
    pytest.importorskip("xgrammar")
    llm = _llm(engine)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = llm.generate({"prompt": "<|media_pad|> Reply in JSON:", "images": [png(8)]},
                       SamplingParams(max_tokens=48, temperature=0.0, guided={"json_schema": schema}))[0]
    assert isinstance(json.loads(out.text)["ok"], bool)
    assert_no_leak(llm)


def test_chat_with_images(engine, vision):
    llm = _llm(engine)
    msgs = [{"role": "user", "content": [{"type": "image", "image": png(9)}, {"type": "text", "text": "What?"},
                                         {"type": "image_url", "image_url": {"url": data_url(png(2))}}]}]
    a, b = llm.chat(msgs, GREEDY), llm.chat(msgs, GREEDY)
    assert a.token_ids == b.token_ids and len(a.token_ids) == GREEDY.max_tokens
    assert a.prompt_token_ids.count(llm.images.placeholder) == 8


@pytest.mark.parametrize("images, text, match", [
    ([b"not a png"], "<|media_pad|>", "not an image in a supported format"),
    ([png(1, 400, 400)], "<|media_pad|>", "limit of 1000 bytes"),
    (["https://example.com/cat.png"], "<|media_pad|>", "remote image URLs are not fetched"),
    (["data:image/png,abc"], "<|media_pad|>", "must be base64"),
    (["data:image/png;base64,@@@"], "<|media_pad|>", "not valid base64"),
    (["/no/such/file.png"], "<|media_pad|>", "no such image file"),
    ([png(1)], "no placeholder", "0 image placeholders"),
    ([png(1), png(2)], "<|media_pad|>", "1 image placeholders"),
    ([42], "<|media_pad|>", "must be a PIL image"),
])
def test_bad_images_are_refused_and_the_engine_runs_on(engine, vision, images, text, match):
    llm = _llm(engine, max_image_bytes=1000)
    with pytest.raises(RequestError, match=match) as e:
        llm.generate({"prompt": text, "images": images}, GREEDY)
    assert e.value.field == "images"
    assert len(llm.generate("still serving", GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert_no_leak(llm)


def _session(takes_embeds: bool):
    return type("Session", (), {"takes_embeds": takes_embeds})()


def test_engines_without_images_refuse_them(tiny_model):
    model = tiny_model[1]
    tower, model.vision = model.vision, None          # a checkpoint without a vision tower
    try:
        with pytest.raises(RequestError, match="no vision tower"):
            ImageIntake.open(model, _session(True), ImageLimits()).prepare([1], [png(1)])
    finally:
        model.vision = tower
    with pytest.raises(RequestError, match="token ids only"):     # an onnx / TensorRT session
        ImageIntake.open(tiny_model[1], _session(False), ImageLimits()).prepare([1], [png(1)])
    assert ImageIntake.open(None, _session(False), ImageLimits()).prepare([1, 2], []).ids == [1, 2]


def test_k3trt_run_chat_with_images(engine, vision, tmp_path):
    files = []
    for i, (w, h) in enumerate([(56, 56), (112, 56)]):
        files.append(tmp_path / f"{i}.png")
        files[-1].write_bytes(png(20 + i, w, h))
    args = ["run", str(engine), "-p", "Compare them.", "--chat", "--max-tokens", "5", "--json",
            "--image", str(files[0]), "--image", str(files[1])]
    runs = [CliRunner().invoke(main, args) for _ in range(2)]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    a, b = (json.loads(r.output) for r in runs)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 5
    assert a["prompt_token_ids"].count(MEDIA_PAD_ID) == 4 + 8
    one = json.loads(CliRunner().invoke(main, args[:-2]).output)
    assert one["prompt_token_ids"].count(MEDIA_PAD_ID) == 4
    r = CliRunner().invoke(main, ["run", str(engine), "-p", "x", "--image", str(files[0])])
    assert r.exit_code != 0 and "--image needs --chat" in r.output
    files[0].write_bytes(b"corrupt")
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0 and "images: image 0: image data is not an image in a supported format" in r.output


@pytest.mark.gpu
def test_image_prompts_on_the_gpu(engine, vision):
    """On CUDA: the encoder and the embeddings' scatter run on the device, deterministically (the
    engine is fp32, which CUDA graphs do not capture; the encoder's graphs: test_encoder_graphs_gpu)."""
    prompts = [{"prompt": TEXT + " <|media_pad|>", "images": [png(1, 112, 112)]},
               {"prompt": "<|media_pad|> and <|media_pad|>", "images": [png(2), png(3, 84, 56)]}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    eager = _llm(engine, device="cuda", cuda_graphs=False)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert want == [o.token_ids for o in eager.generate(prompts, params)]
    assert all(len(w) == params.max_tokens for w in want)
    assert_no_leak(eager)
