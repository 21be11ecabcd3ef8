"""Quantized weight formats: element codecs against hand-computed values, round trips within each
format's error bound (exact on the grid), and strict per-prefix loading."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from k3trt.model import quant as q
from k3trt.model.checkpoint_io import CheckpointError, CheckpointReader
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.testing import assert_close

GEN = lambda seed=0: torch.Generator().manual_seed(seed)  # noqa: E731


# --------------------------------------------------------------------------- element codecs
def test_e2m1_table():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = q.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == want
    assert torch.signbit(got).tolist() == [False] * 8 + [True] * 8


@pytest.mark.parametrize("x, code", [
    (0.0, 0), (0.1, 0), (0.25, 0), (0.26, 1), (0.5, 1), (0.75, 2), (1.0, 2), (1.25, 2),
    (1.3, 3), (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.6, 5), (3.0, 5), (3.5, 6),
    (4.0, 6), (5.0, 6), (5.01, 7), (6.0, 7), (7.0, 7), (1e30, 7),
    (-0.75, 10), (-5.0, 14), (-100.0, 15), (-0.0, 8), (-0.1, 8),
])
def test_e2m1_round_to_nearest_even_by_hand(x, code):
    assert q.e2m1_encode(torch.tensor([x])).item() == code


def test_e2m1_encode_matches_brute_force_oracle():
    xs = torch.linspace(-8, 8, 4097)  # step 1/256: hits every midpoint exactly
    mags = list(q.E2M1_VALUES)

    def oracle(x: float) -> int:
        a = min(abs(x), 6.0)
        best = min(range(8), key=lambda i: (abs(a - mags[i]), i % 2))  # tie: even index
        return best | (8 if math.copysign(1, x) < 0 else 0)
    assert q.e2m1_encode(xs).tolist() == [oracle(x) for x in xs.tolist()]


def test_e8m0_decode_by_hand():
    codes = torch.tensor([127, 128, 126, 130, 120, 1, 0, 254, 255], dtype=torch.uint8)
    got = q.e8m0_decode(codes).tolist()
    assert got[:8] == [1.0, 2.0, 0.5, 8.0, 1 / 128, 2.0**-126, 2.0**-127, 2.0**127]
    assert math.isnan(got[8])


# --------------------------------------------------------------------------- mxfp4
def test_mxfp4_nibble_order_and_scale_by_hand():
    # Row 0: amax 6 -> scale 1 (byte 127); codes 0.5 (1), 1.0 (2), -6 (15), 0 (0).
    # Row 1: amax 1.5 = 6 * 2**-2 -> byte 125; 0.375 / 0.25 = 1.5 -> code 3.
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([0.5, 1.0, -6.0, 0.0])
    w[1, :2] = torch.tensor([1.5, 0.375])
    packed, scale = q.mxfp4_encode(w)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (2, 16) and scale.shape == (2, 1)
    assert packed[0, :2].tolist() == [0x21, 0x0F] and packed[1, 0].item() == 0x37
    assert scale.flatten().tolist() == [127, 125]
    assert torch.equal(q.mxfp4_decode(packed, scale), w)


@pytest.mark.parametrize("amax, byte", [
    (6.0, 127), (4.0, 127), (7.0, 128), (1.7, 125), (1.75, 126), (1e-38, 0), (0.0, 127),
    (3.0 * 2.0**100, 226),
])
def test_mxfp4_group_scale_choice(amax, byte):
    w = torch.zeros(1, 32)
    w[0, 5] = amax
    _, scale = q.mxfp4_encode(w)
    assert scale.item() == byte


@pytest.mark.parametrize("shape", [(3, 64), (5, 70), (1, 2), (2, 3, 96), (7, 33 * 2)])
def test_mxfp4_round_trip_within_format_error(shape):
    w = torch.randn(*shape, generator=GEN()) * 0.02
    packed, scale = q.mxfp4_encode(w)
    k = shape[-1]
    assert packed.shape == (*shape[:-1], k // 2) and scale.shape == (*shape[:-1], -(-k // 32))
    d = q.mxfp4_decode(packed, scale)
    # Every element is within one scale unit (half the widest E2M1 step, 4 -> 6) of its input,
    # and within 2/7 of its group's amax (the scale rule keeps amax >= 3.5 scale units).
    s = q.e8m0_decode(scale).repeat_interleave(32, -1)[..., :k]
    err = (d - w).abs()
    assert (err <= s).all()
    amax = torch.nn.functional.pad(w.abs(), (0, -k % 32)).unflatten(-1, (-1, 32)).amax(-1)
    assert (err <= amax.repeat_interleave(32, -1)[..., :k] * 2 / 7 + 1e-12).all()
    assert_close(d, w, atol=1.0, rtol=1.0, rel_norm=0.15)


def test_mxfp4_exact_on_grid():
    g = GEN(1)
    packed = torch.randint(0, 256, (16, 80), dtype=torch.uint8, generator=g)
    scale = torch.randint(100, 150, (16, 5), dtype=torch.uint8, generator=g)
    x = q.mxfp4_decode(packed, scale)
    p2, s2 = q.mxfp4_encode(x)
    assert torch.equal(q.mxfp4_decode(p2, s2), x)
    # Bytes are canonical too wherever a group's largest magnitude is 4 or 6 (index >= 6):
    # then the encoder picks the same scale, and so the same codes.
    top = torch.maximum(packed & 7, (packed >> 4) & 7).unflatten(-1, (5, 16)).amax(-1)
    canon = top >= 6
    assert canon.any() and torch.equal(s2[canon], scale[canon])
    assert torch.equal(p2.unflatten(-1, (5, 16))[canon], packed.unflatten(-1, (5, 16))[canon])


def test_mxfp4_rejects_odd_and_nonfinite():
    with pytest.raises(ValueError, match="must be even"):
        q.mxfp4_encode(torch.ones(2, 31))
    with pytest.raises(ValueError, match="inf/NaN"):
        q.mxfp4_encode(torch.tensor([[1.0, float("nan")]]))


# --------------------------------------------------------------------------- fp8 block
def _fp8_oracle(fp8, s, block=(128, 128)):
    out = torch.empty(fp8.shape)
    for i, j in itertools.product(range(fp8.shape[0]), range(fp8.shape[1])):
        out[i, j] = fp8[i, j].float() * s[i // block[0], j // block[1]]
    return out


def test_fp8_decode_matches_per_element_definition():
    g = GEN(2)
    fp8 = (torch.randn(130, 131, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=g) + 0.01  # arbitrary fp32 scales, as DeepSeek ships them
    assert torch.equal(q.fp8_block_decode(fp8, s), _fp8_oracle(fp8, s))
    assert q.fp8_block_decode(fp8, s, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fp8_encode_by_hand():
    w = torch.tensor([[1.0, 2.0], [-448.0, 0.0]])
    fp8, s = q.fp8_block_encode(w)
    assert s.tolist() == [[1.0]] and fp8.float().tolist() == w.tolist()
    # amax 1344 -> smallest 2**e with 1344 <= 448 * 2**e is 4; -1344 / 4 = -336 lies halfway
    # between -320 (mantissa 010) and -352 (011): ties go to the even mantissa.
    fp8, s = q.fp8_block_encode(w * 3)
    assert s.tolist() == [[4.0]] and fp8.float().tolist() == [[0.75, 1.5], [-320.0, 0.0]]
    _, s = q.fp8_block_encode(torch.zeros(3, 3))
    assert s.tolist() == [[1.0]]


@pytest.mark.parametrize("shape", [(130, 300), (1, 1), (128, 128), (257, 129), (3, 200)])
def test_fp8_round_trip_within_format_error(shape):
    w = torch.randn(*shape, generator=GEN(3)) * 0.05
    fp8, s = q.fp8_block_encode(w)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    d = q.fp8_block_decode(fp8, s)
    # E4M3 has 3 mantissa bits: half an ulp is 2**-4 relative; below 2**-6 (subnormal) the step
    # is 2**-9 of the block scale, so half of it is the absolute floor.
    se = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert ((d - w).abs() <= w.abs() * 2.0**-4 + se * 2.0**-10).all()
    # RMS error of 3-bit-mantissa rounding is ~2-3 %: the comparator's fp8 default budget (1 %)
    # is for fp8 *computations*, not for the storage format's own rounding.
    assert_close(d, w, dtype=torch.float8_e4m3fn, rel_norm=0.04)


def test_fp8_exact_on_grid():
    g = GEN(4)
    raw = torch.randint(0, 256, (200, 150), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0  # drop the NaN encodings
    fp8 = raw.view(torch.float8_e4m3fn)
    s = torch.ldexp(torch.ones(2, 2), torch.randint(-20, 5, (2, 2), generator=g))
    x = q.fp8_block_decode(fp8, s)
    fp8_2, s2 = q.fp8_block_encode(x)
    assert torch.equal(q.fp8_block_decode(fp8_2, s2), x)


# --------------------------------------------------------------------------- detection + load
P = "model.layers.3.block_sparse_moe.experts.5.w1"


def _reader(tmp_path, tensors):
    write_checkpoint(tmp_path, {**tensors, "other.weight": torch.ones(2, 2)}, max_shard_bytes=1 << 20)
    return CheckpointReader(tmp_path)


@pytest.mark.parametrize("fmt, names, tol", [
    ("plain", [".weight"], dict(atol=0, rtol=0, rel_norm=0)),
    ("fp8", [".weight", ".weight_scale_inv"], dict(dtype=torch.float8_e4m3fn, rel_norm=0.04)),
    ("mxfp4", [".weight_packed", ".weight_scale"], dict(atol=1, rtol=1, rel_norm=0.15)),
])
@pytest.mark.parametrize("shape", [(64, 96), (130, 70)])
def test_load_linear_weight_each_format(tmp_path, fmt, names, tol, shape):
    w = torch.randn(*shape, generator=GEN(5)).to(torch.bfloat16)
    tensors = q.quantize_for_checkpoint(P + ".weight", w, fmt)
    assert sorted(tensors) == sorted(P + n for n in names)
    assert q.quantize_for_checkpoint(P, w, fmt).keys() == tensors.keys()
    with _reader(tmp_path, tensors) as r:
        assert q.detect_format(r, P) is q.WeightFormat(fmt)
        got = q.load_linear_weight(r, P, out_dtype=torch.float32, expected_shape=shape)
        assert got.dtype == torch.float32 and got.shape == shape
        assert r.unconsumed() == ["other.weight"]  # exactly this format's tensors consumed
    assert_close(got, w.float(), **tol)


def test_read_linear_weight_keeps_packed_form(tmp_path):
    w = torch.randn(8, 64, generator=GEN(6))
    with _reader(tmp_path, q.quantize_for_checkpoint(P, w, "mxfp4")) as r:
        qw = q.read_linear_weight(r, P)
    assert qw.format is q.WeightFormat.MXFP4 and qw.shape == (8, 64)
    assert qw.tensors["weight_packed"].shape == (8, 32)
    assert torch.equal(qw.dequantize(torch.float32), q.mxfp4_decode(*q.mxfp4_encode(w)))


def test_mxfp4_weight_shape_accepted_and_checked(tmp_path):
    w = torch.randn(4, 62, generator=GEN(7))
    t = q.quantize_for_checkpoint(P, w, "mxfp4")
    with _reader(tmp_path / "a", {**t, P + ".weight_shape": torch.tensor([4, 61])}) as r:
        got = q.load_linear_weight(r, P, out_dtype=torch.float32)
        assert got.shape == (4, 61) and r.unconsumed() == ["other.weight"]
    assert torch.equal(got, q.mxfp4_decode(*q.mxfp4_encode(w))[:, :61])
    with _reader(tmp_path / "b", {**t, P + ".weight_shape": torch.tensor([4, 80])}) as r:
        with pytest.raises(CheckpointError, match=re.escape(f"{P}.weight_shape: says [4, 80]")):
            q.load_linear_weight(r, P, out_dtype=torch.float32)


W = torch.randn(8, 64, generator=GEN(8))
MX = q.quantize_for_checkpoint(P, W, "mxfp4")
F8 = q.quantize_for_checkpoint(P, W, "fp8")


def test_missing_weight_is_a_key_error_naming_prefix_and_dir(tmp_path):
    with _reader(tmp_path, {}) as r, pytest.raises(KeyError) as e:
        q.load_linear_weight(r, P, out_dtype=torch.bfloat16)
    assert f"no weight for '{P}'" in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize("tensors, pattern", [
    ({P + ".weight": W, **MX}, f"'{P}' has tensors \\['weight', 'weight_packed', 'weight_scale'\\]"),
    ({P + ".weight": W, P + ".weight_scale": torch.ones(1)}, "match no single weight format"),
    ({P + ".weight_packed": MX[P + ".weight_packed"]}, "match no single weight format"),
    ({**F8, P + ".weight_global_scale": torch.ones(1)}, "match no single weight format"),
    ({P + ".weight": W[0]}, f"{P}.weight: want a 2-D"),
    ({P + ".weight": F8[P + ".weight"]}, f"{P}.weight: want a bf16/fp16/fp32 weight, got torch.float8"),
    ({P + ".weight": W, P + ".weight_scale_inv": torch.ones(1, 1)}, f"{P}.weight: want float8_e4m3fn"),
    ({**F8, P + ".weight_scale_inv": torch.ones(1, 2)},
     re.escape(f"{P}.weight_scale_inv: want float32 [1, 1] for a [8, 64] weight")),
    ({**F8, P + ".weight_scale_inv": torch.ones(1, 1, dtype=torch.bfloat16)}, "got torch.bfloat16"),
    ({**MX, P + ".weight_scale": torch.ones(8, 3, dtype=torch.uint8)},
     re.escape(f"{P}.weight_scale: want uint8 [8, 2]")),
    ({**MX, P + ".weight_packed": MX[P + ".weight_packed"].to(torch.int8)},
     f"{P}.weight_packed: want uint8"),
])
def test_load_linear_weight_errors_name_prefix_or_tensor(tmp_path, tensors, pattern):
    with _reader(tmp_path, tensors) as r, pytest.raises(CheckpointError, match=pattern):
        q.load_linear_weight(r, P, out_dtype=torch.bfloat16)


def test_load_linear_weight_expected_shape(tmp_path):
    with _reader(tmp_path, F8) as r, pytest.raises(CheckpointError, match=re.escape(
            f"{P}: weight shape [8, 64] (from {P}.weight) != expected [64, 8]")):
        q.load_linear_weight(r, P, out_dtype=torch.bfloat16, expected_shape=(64, 8))


def test_quantize_for_checkpoint_rejects_unknown():
    with pytest.raises(ValueError):
        q.quantize_for_checkpoint(P, W, "nvfp4")
    with pytest.raises(ValueError, match="2-D"):
        q.quantize_for_checkpoint(P, W[0], "fp8")


# --------------------------------------------------------------------------- config
K3_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
             "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


def test_configs_parse():
    spec = q.parse_quantization_config(q.mxfp4_quantization_config(K3_IGNORE))
    assert spec.method == "mxfp4" and spec.group_size == 32
    assert spec.is_ignored("model.layers.1.self_attn.q_b_proj")
    assert spec.is_ignored("model.layers.0.mlp.gate_proj")
    assert not spec.is_ignored("model.layers.3.block_sparse_moe.experts.5.w1")
    cfg = q.mxfp4_quantization_config()
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "mxfp4-pack-quantized"
    w = cfg["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == (4, "float", "group", 32)
    fp8 = q.fp8_quantization_config()
    assert fp8 == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}
    assert q.parse_quantization_config(fp8).fp8_block == (128, 128)
    assert q.parse_quantization_config(None).method == "none"


def test_config_errors_name_the_field():
    cfg = q.mxfp4_quantization_config()
    cfg["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ValueError, match="config_groups.group_0.weights.group_size: expected 32"):
        q.parse_quantization_config(cfg)
    with pytest.raises(ValueError, match="activation_scheme"):
        q.parse_quantization_config({**q.fp8_quantization_config(), "activation_scheme": "static"})
    with pytest.raises(ValueError, match="weight_block_size"):
        q.parse_quantization_config({**q.fp8_quantization_config(), "weight_block_size": [128]})
    with pytest.raises(ValueError, match="quant_method: unsupported 'awq'"):
        q.parse_quantization_config({"quant_method": "awq"})
