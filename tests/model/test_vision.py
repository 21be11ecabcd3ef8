"""The vision tower + projector against transformers' kimi_k25 (fp32, copied weights, several image
sizes and several images per call), the padded masked path against the per-image one, the
position-table resampling against F.interpolate, preprocessing against the released processor
(where torchvision is installed) and against its rules written out, load_image's errors, and the
config's two spellings."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from model_utils import random_vision_encoder
import torch
import transformers
from PIL import Image
from torch.nn import functional as F

from k3trt.config import ConfigError, ModelConfig
from k3trt.model.presets import preset_config
from k3trt.model.vision import (GridError, ImageError, VisionConfig, VisionConfigError, VisionEncoder, image_grid,
                                load_image, num_image_tokens, preprocess, vision_batch)
from k3trt.model.vision.preprocess import resized_size
from k3trt.testing import assert_close, rel_norm_error

kimi = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
kcfg = pytest.importorskip("transformers.models.kimi_k25.configuration_kimi_k25")
# the reference's multi-frame path raises inside transformers 5.17's own code (a shape mismatch in
# its position embedding); 5.25, the CI's, runs it
REFERENCE_RUNS_CLIPS = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 25)

# heads 2, head_dim 16; an 8×8 table resampled up and down; text hidden 48
VC = VisionConfig(text_hidden_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, pos_emb_height=8, pos_emb_width=8)
GRIDS = {
    "one image": [(1, 4, 6)],
    "table size": [(1, 8, 8)],
    "several sizes": [(1, 4, 6), (1, 12, 8), (1, 2, 2), (1, 10, 4)],
    "a two-frame clip": [(1, 6, 4), (2, 4, 4)],
}


@pytest.fixture(scope="module")
def encoder():
    return random_vision_encoder(VC)


def hf_modules(enc: VisionEncoder):
    """transformers' tower and projector with `enc`'s weights, converted as its conversion_mapping
    does: blocks renamed, wqkv split into q/k/v, q and k permuted from interleaved RoPE pairs to
    rotated halves."""
    vc = enc.cfg
    hv = kcfg.Kimi_K25VisionConfig(patch_size=vc.patch_size, pos_emb_height=vc.pos_emb_height,
                                   pos_emb_width=vc.pos_emb_width, pos_emb_time=vc.pos_emb_time,
                                   num_attention_heads=vc.num_attention_heads, num_hidden_layers=vc.num_hidden_layers,
                                   hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                                   rope_parameters={"rope_type": "axial", "rope_theta": vc.rope_theta})
    top = kcfg.Kimi_K25Config(vision_config=hv.to_dict(), projection_hidden_size=vc.hidden_size,
                              text_config={"model_type": "deepseek_v3", "hidden_size": vc.text_hidden_size})
    top.vision_config._attn_implementation = "sdpa"
    tower = kimi.Kimi_K25VisionModel(top.vision_config).float().eval()
    proj = kimi.Kimi_K25MultimodalProjection(top).float().eval()
    H, d = vc.num_attention_heads, vc.head_dim

    def halves(t):
        return t.reshape(H, d // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    src = {n: p.detach() for n, p in enc.named_parameters()}
    sd = {"patch_embed.proj.weight": src["vision_tower.patch_embed.proj.weight"],
          "patch_embed.proj.bias": src["vision_tower.patch_embed.proj.bias"],
          "patch_embed.pos_emb.position_embeddings": src["vision_tower.patch_embed.pos_emb.weight"],
          "final_layernorm.weight": src["vision_tower.encoder.final_layernorm.weight"],
          "final_layernorm.bias": src["vision_tower.encoder.final_layernorm.bias"]}
    for b in range(vc.num_hidden_layers):
        ours, theirs = f"vision_tower.encoder.blocks.{b}.", f"layers.{b}."
        for a, c in (("norm0", "norm1"), ("norm1", "norm2"), ("wo", "attn.proj"), ("mlp.fc0", "mlp.fc1"),
                     ("mlp.fc1", "mlp.fc2")):
            for k in ("weight", "bias"):
                sd[f"{theirs}{c}.{k}"] = src[f"{ours}{a}.{k}"]
        for k in ("weight", "bias"):
            q, kk, v = src[f"{ours}wqkv.{k}"].chunk(3)
            sd.update({f"{theirs}attn.q_proj.{k}": halves(q), f"{theirs}attn.k_proj.{k}": halves(kk),
                       f"{theirs}attn.v_proj.{k}": v})
    tower.load_state_dict(sd)
    proj.load_state_dict({"pre_norm.weight": src["mm_projector.pre_norm.weight"],
                          "pre_norm.bias": src["mm_projector.pre_norm.bias"],
                          "in_proj.weight": src["mm_projector.proj.0.weight"],
                          "in_proj.bias": src["mm_projector.proj.0.bias"],
                          "out_proj.weight": src["mm_projector.proj.2.weight"],
                          "out_proj.bias": src["mm_projector.proj.2.bias"]})
    return tower, proj


@pytest.fixture(scope="module")
def reference(encoder):
    tower, proj = hf_modules(encoder)

    def run(pixels, grids):
        with torch.no_grad():
            return proj(tower(pixels, grid_thw=grids).pooler_output).squeeze(1)
    return run


def pixels_for(grids, seed):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, VC.patch_size, VC.patch_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(GRIDS))
def test_tower_and_projector_match_transformers(encoder, reference, case):
    if any(t > 1 for t, _, _ in GRIDS[case]) and not REFERENCE_RUNS_CLIPS:
        pytest.skip(f"transformers {transformers.__version__}'s kimi_k25 fails on multi-frame grids; needs >= 5.25")
    grids = torch.tensor(GRIDS[case])
    pixels = pixels_for(GRIDS[case], seed=len(case))
    with torch.no_grad():
        out = encoder(pixels, grids)
    ref = reference(pixels, grids)
    assert out.shape == (sum(num_image_tokens(VC, g) for g in GRIDS[case]), VC.text_hidden_size)
    assert rel_norm_error(out, ref) <= 1e-4
    assert_close(out, ref, dtype=torch.float32, atol=1e-4, rtol=1e-3)


def test_padded_masked_batch_equals_per_image(encoder):
    """The exported graph's path: one SDPA under a same-image mask over a capacity-padded batch."""
    grids = GRIDS["several sizes"]
    pixels = pixels_for(grids, seed=7)
    batch = vision_batch(VC, grids, capacity=512)
    padded = torch.zeros(512, 3, VC.patch_size, VC.patch_size)      # the graph contract: padding rows zero
    padded[: len(pixels)] = pixels
    with torch.no_grad():
        out = encoder.encode(padded, batch, attention="masked")
        ref = encoder(pixels, torch.tensor(grids))
    assert out.shape == (512 // 4, VC.text_hidden_size)
    assert_close(out[: batch.num_tokens], ref, dtype=torch.float32)
    with pytest.raises(ValueError, match="attention='masked'"):
        encoder.encode(padded, batch, attention="sdpa")


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 8, 8), (1, 12, 20), (1, 2, 2)])
def test_position_table_resampled_as_f_interpolate(encoder, grid):
    """The bicubic taps (geometry.cubic_taps) against F.interpolate on the table, per image."""
    _, h, w = grid
    table = encoder.vision_tower.patch_embed.pos_emb.weight.detach()
    ref = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
    ref = ref[0].permute(1, 2, 0).reshape(h * w, -1)
    out = encoder.vision_tower.patch_embed.pos_emb(vision_batch(VC, [grid]))
    assert_close(out, ref, dtype=torch.float32)


def test_attention_modes(encoder):
    """On the CPU "auto" is per-image SDPA and varlen is refused with the reason."""
    grids = GRIDS["several sizes"]
    pixels = pixels_for(grids, seed=5)
    batch = vision_batch(VC, grids)
    with torch.no_grad():
        ref = encoder.encode(pixels, batch, attention="masked")
        assert_close(encoder.encode(pixels, batch), ref, dtype=torch.float32)
        assert_close(encoder.encode(pixels, batch, attention="sdpa"), ref, dtype=torch.float32)
        with pytest.raises(ValueError, match="needs torch.nn.attention.varlen and CUDA"):
            encoder.encode(pixels, batch, attention="varlen")
        with pytest.raises(ValueError, match="choose auto"):
            encoder.encode(pixels, batch, attention="flash")


def test_grid_and_input_errors(encoder):
    assert num_image_tokens(VC, (1, 12, 8)) == 24 and num_image_tokens(VC, (2, 4, 4)) == 4
    with pytest.raises(GridError, match="multiples of merge_kernel_size"):
        num_image_tokens(VC, (1, 5, 4))
    with pytest.raises(GridError, match="at most 4 frames"):
        vision_batch(VC, [(5, 2, 2)])
    with pytest.raises(GridError, match="do not fit the encoder capacity 16"):
        vision_batch(VC, [(1, 4, 6)], capacity=16)
    with pytest.raises(ValueError, match="need 24"):
        encoder(torch.zeros(20, 3, 14, 14), torch.tensor([[1, 4, 6]]))


# ------------------------------------------------------------------------------ preprocessing
def random_image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if bands == 1 else data, mode)


IMAGES = [("RGB", 100, 150), ("L", 640, 480), ("RGB", 3000, 2000), ("RGB", 20, 9000)]


def test_preprocess_matches_the_released_processor():
    """Grids and pixels of images without alpha (transformers versions differ on alpha: 5.17 drops
    it, 5.25 composites over white, as preprocess does: test_alpha_is_composited_over_white)."""
    pytest.importorskip("torchvision")
    processing = pytest.importorskip("transformers.models.kimi_k25.image_processing_kimi_k25")
    images = [random_image(w, h, mode, seed=i) for i, (mode, w, h) in enumerate(IMAGES)]
    cfg = VisionConfig(text_hidden_size=48)
    ref = processing.Kimi_K25ImageProcessor()(images, return_tensors="pt")
    pixels, grids = preprocess(images, cfg)
    assert torch.equal(grids, ref["image_grid_thw"])
    assert_close(pixels, ref["pixel_values"], dtype=torch.float32, atol=1e-5, rtol=1e-5)


def test_alpha_is_composited_over_white():
    """As transformers' convert_to_rgb (the processor's do_convert_rgb) does from 5.25."""
    if not REFERENCE_RUNS_CLIPS:
        pytest.skip(f"transformers {transformers.__version__} converts alpha otherwise; the rule is 5.25's")
    from transformers.image_transforms import convert_to_rgb  # noqa: PLC0415 (only this test)

    from k3trt.model.vision.preprocess import to_rgb  # noqa: PLC0415
    for mode in ("RGBA", "LA", "P"):
        img = random_image(37, 23, "RGBA", seed=7)
        img = img.convert(mode) if mode != "P" else img.convert("RGB").convert("P")
        if mode == "P":
            img.info["transparency"] = 0
        assert np.array_equal(np.asarray(to_rgb(img)), convert_to_rgb(img, return_numpy=True)), mode


def test_preprocess_rules():
    """Sizes by the released rules; pixels of an image that needs no resize, exactly."""
    cfg = VisionConfig(text_hidden_size=48)
    assert resized_size(cfg, 100, 150) == ((100, 150), (112, 168))
    assert image_grid(cfg, 100, 150) == (1, 8, 12)
    # over the 16384-patch budget: scaled down (the budget is before the padding, as released)
    (h, w), (ph, pw) = resized_size(cfg, 3000, 2000)
    assert (h // 14) * (w // 14) <= cfg.max_patches < (ph // 14) * (pw // 14) and abs(h / w - 1.5) < 0.01
    assert resized_size(cfg, 9000, 20)[0][0] == 512 * 14         # one side capped at 512 patches
    img = random_image(30, 20, seed=3)
    pixels, grids = preprocess([img], cfg)
    assert grids.tolist() == [[1, 2, 4]]
    full = torch.full((3, 28, 56), -1.0)                         # padding: (0 - 0.5) / 0.5
    full[:, :20, :30] = torch.from_numpy(np.asarray(img)).permute(2, 0, 1).float() / 255 * 2 - 1
    want = full.reshape(3, 2, 14, 4, 14).permute(1, 3, 0, 2, 4).reshape(8, 3, 14, 14)
    assert_close(pixels, want, dtype=torch.float32, atol=1e-6, rtol=1e-6)


def test_preprocessed_images_run_through_the_tiny_model(tiny_model):
    cfg, model = tiny_model
    pixels, grids = preprocess([random_image(60, 45), random_image(33, 90, "RGBA")], cfg.vision)
    with torch.no_grad():
        out = model.vision(pixels, grids)
    assert out.shape == (sum(num_image_tokens(cfg.vision, tuple(g)) for g in grids.tolist()), cfg.hidden_size)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------ load_image
def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width × height pixels and holds none (what a decompression bomb's
    header looks like to the size checks)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_load_image_reads_bytes_and_files(tmp_path):
    data = encoded(random_image(40, 30))
    assert load_image(data, max_bytes=1 << 20, max_pixels=10_000).size == (40, 30)
    (tmp_path / "a.jpg").write_bytes(encoded(random_image(40, 30), "JPEG"))
    assert load_image(tmp_path / "a.jpg", max_bytes=1 << 20, max_pixels=10_000).size == (40, 30)


@pytest.mark.parametrize("source, limits, match", [
    (b"not an image at all", {}, "not an image in a supported format"),
    ("truncated", {}, "corrupt or truncated"),
    ("ico", {}, "not an image in a supported format"),
    ("big", {"max_bytes": 100}, "over the limit of 100"),
    ("png", {"max_pixels": 1000}, "over the limit of 1000"),
    ("bomb", {"max_pixels": 10 ** 12}, "too large to decode safely"),
    ("header only", {}, "corrupt or truncated"),
    ("https://example.com/cat.png", {}, "is a URL"),
    ("/no/such/file.png", {}, "does not exist"),
    (b"", {}, "is empty"),
])
def test_load_image_errors_say_what_and_how(source, limits, match):
    png = encoded(random_image(40, 30))
    source = {"truncated": png[: len(png) // 2], "ico": encoded(random_image(16, 16), "ICO"), "big": png,
              "png": png, "bomb": png_header_only(30000, 30000),
              "header only": png_header_only(40, 30)}.get(source, source) if isinstance(source, str) else source
    with pytest.raises(ImageError, match=match):
        load_image(source, **{"max_bytes": 1 << 20, "max_pixels": 10_000, **limits})


# ------------------------------------------------------------------------------ config
def test_released_and_transformers_spellings_parse_alike():
    released = preset_config("tiny", 1024)
    cfg = ModelConfig.from_dict(released)
    assert cfg.vision.hidden_size == 32 and cfg.vision.text_hidden_size == cfg.hidden_size
    hf = {**released, "projection_hidden_size": 32, "projection_layer_norm_eps": 1e-5,
          "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                            "num_hidden_layers": 2, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 4,
                            "patch_size": 14, "merge_kernel_size": [2, 2], "hidden_act": "gelu_pytorch_tanh",
                            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}}
    assert ModelConfig.from_dict(hf).vision == cfg.vision
    text_only = {k: v for k, v in released.items() if k != "vision_config"}
    assert ModelConfig.from_dict(text_only).vision is None


@pytest.mark.parametrize("edit, match", [
    (dict(merge_type="sd2"), "vision_config.merge_type"),
    (dict(vt_num_attention_heads=3), "vision_config.num_attention_heads"),
    (dict(text_hidden_size=7), "vision_config.text_hidden_size"),
    (dict(mm_hidden_size=64), "vision_config.mm_hidden_size"),
])
def test_bad_vision_configs_name_the_field(edit, match):
    raw = preset_config("tiny", 1024)
    raw["vision_config"].update(edit)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)
    with pytest.raises(VisionConfigError):
        VisionConfig.from_dict(raw["vision_config"], text_hidden_size=64)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["varlen", "sdpa", "masked"])
def test_bf16_on_the_gpu_matches_fp32(encoder, attention):
    """Each attention path (varlen flash, per-image SDPA, the masked capacity path) in bf16 against
    the fp32 CPU run."""
    masked = attention == "masked"
    grids = GRIDS["several sizes"]
    pixels = pixels_for(grids, seed=11)
    with torch.no_grad():
        ref = encoder(pixels, torch.tensor(grids))
        gpu = VisionEncoder(VC).to("cuda", torch.bfloat16).eval()
        gpu.load_state_dict(encoder.state_dict())
        batch = vision_batch(VC, grids, capacity=512 if masked else None).to("cuda")
        padded = torch.zeros(batch.pos_index.shape[0], 3, 14, 14)
        padded[: len(pixels)] = pixels
        out = gpu.encode(padded.to("cuda", torch.bfloat16), batch, attention=attention)[: batch.num_tokens]
    assert rel_norm_error(out.float().cpu(), ref) <= 2e-2
