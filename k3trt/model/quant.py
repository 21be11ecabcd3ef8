"""Quantized linear-weight formats in checkpoints: detection, decode (to load) and encode (to make
test checkpoints), in plain torch. A linear weight is logically [out, in]; a checkpoint stores the
module `X` (e.g. "model.layers.3.block_sparse_moe.experts.5.w1") in exactly one of these forms:

plain      X.weight            any float dtype [out, in]
fp8        X.weight            float8_e4m3fn [out, in]                         (DeepSeek-V3)
           X.weight_scale_inv  float32 [ceil(out/128), ceil(in/128)]
           weight = fp8 * scale_inv of its 128x128 block (edge blocks are partial).
           config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
mxfp4      X.weight_packed     uint8 [out, ceil(in/2)]: two FP4 E2M1 codes per byte, element 2j
                               in the LOW nibble, 2j+1 in the HIGH nibble (compressed-tensors
                               pack_fp4_to_uint8); code = sign(bit 3) | magnitude index (bits 0-2)
                               into E2M1_VALUES.
           X.weight_scale      uint8 [out, ceil(in/32)]: E8M0, scale = 2**(byte - 127) for the
                               32 consecutive inputs of its group (byte 255 = NaN, per OCP MX).
           X.weight_shape      optional int [2] = (out, in); compressed-tensors' mxfp4 writer does
                               not emit it, but it is accepted (and checked) if present.
           weight = e2m1(code) * scale. config: `mxfp4_quantization_config()` (compressed-tensors
           "mxfp4-pack-quantized", as Kimi K3 ships its routed experts).

Choices made here (the sources leave them open):
- mxfp4 encode rounds to nearest, ties to even code, saturating at ±6 (compressed-tensors'
  packer breaks ties toward the smaller magnitude instead). The group scale follows
  compressed-tensors: 2**(floor(log2(amax)) - 2), one exponent higher when amax's mantissa is
  ≥ 1.75 (so such a group rounds to 4·scale instead of clipping at 6·scale); all-zero groups get
  scale 1 (byte 127). Signs are kept, so -0.0 encodes as code 8 like upstream.
- in % 32 != 0 is allowed for mxfp4: the last group is partial (vLLM needs in % 32 == 0).
  in must be even unless X.weight_shape says otherwise.
- fp8 encode uses power-of-two scale_inv = 2**ceil(log2(amax/448)) per block (DeepSeek's own
  scales are arbitrary fp32 amax/448; the decoder takes any fp32). Power-of-two scales make
  decode exact and encode(decode(q)) == decode(q) for any on-grid input; all-zero blocks get 1.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from k3trt.model.checkpoint_io import CheckpointError, MissingTensorError

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
E2M1_MAX = 6.0
# Round-to-nearest-even on the E2M1 grid: the magnitude index goes up past each midpoint, and on
# the midpoint itself only when the upper neighbour's index (its mantissa bit) is even.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))
E8M0_BIAS, E8M0_NAN = 127, 255
MXFP4_GROUP = 32
FP8_MAX = 448.0
FP8_BLOCK = (128, 128)
MXFP4_FORMAT = "mxfp4-pack-quantized"


class WeightFormat(enum.Enum):
    PLAIN = "plain"
    FP8_BLOCK = "fp8"
    MXFP4 = "mxfp4"


@dataclass(frozen=True)
class FormatTensors:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


# Which suffixes of a module prefix make up each format (the table detection reads).
FORMAT_TENSORS = {
    WeightFormat.PLAIN: FormatTensors(("weight",)),
    WeightFormat.FP8_BLOCK: FormatTensors(("weight", "weight_scale_inv")),
    WeightFormat.MXFP4: FormatTensors(("weight_packed", "weight_scale"), ("weight_shape",)),
}
# Every weight-family suffix looked at; the last two (NVFP4 / asymmetric) make detection fail
# loudly instead of leaving them for the strict loader to report as unexplained leftovers.
WEIGHT_SUFFIXES = ("weight", "weight_scale_inv", "weight_packed", "weight_scale", "weight_shape",
                   "weight_global_scale", "weight_zero_point")


# --------------------------------------------------------------------------- element codecs
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Already-scaled values -> E2M1 codes (uint8 0..15), RNE, saturating at ±6."""
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        mag += (a > mid) | (a == mid) if tie_up else (a > mid)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([mags, -mags])
    return table[(codes & 0xF).long()]


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2**(c - 127), built from the bit pattern so it is exact: c >= 1 is a
    normal float with exponent field c; c == 0 is the subnormal 2**-127; c == 255 is NaN."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), c << 23)
    bits = torch.where(c == E8M0_NAN, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _pow2_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest integer e with amax <= limit * 2**e, exactly (frexp, no log2 rounding).
    `limit` must be m * 2**k with m in [0.5, 1)."""
    lm, lk = math.frexp(limit)
    m, e = torch.frexp(amax)
    return e - lk + (m > lm).to(e.dtype)


def _check_finite(name: str, w: torch.Tensor) -> torch.Tensor:
    w = w.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError(f"{name}: cannot quantize a weight with inf/NaN")
    return w


# --------------------------------------------------------------------------- mxfp4
def mxfp4_encode(w: torch.Tensor, group: int = MXFP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., in] float -> (packed uint8 [..., in/2], scale uint8 [..., ceil(in/group)])."""
    w = _check_finite("mxfp4_encode", w)
    *lead, k = w.shape
    if k % 2:
        raise ValueError(f"mxfp4_encode: the input dim ({k}) must be even to pack two per byte")
    ng = -(-k // group)
    g = torch.nn.functional.pad(w, (0, ng * group - k)).reshape(*lead, ng, group)
    amax = g.abs().amax(-1)
    m, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2 amax) = e - 1
    exp = (e - 1) - 2 + (m >= 0.875).to(e.dtype)  # -2: E2M1's top exponent; 0.875: mantissa 1.75
    exp = torch.where(amax == 0, torch.zeros_like(exp), exp).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = (exp + E8M0_BIAS).to(torch.uint8)
    codes = e2m1_encode(g / e8m0_decode(scale).unsqueeze(-1)).reshape(*lead, ng * group)[..., :k]
    pairs = codes.reshape(*lead, k // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), scale


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, *, in_features: int | None = None,
                 group: int = MXFP4_GROUP, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 [..., ceil(in/2)], scale uint8 [..., ceil(in/group)]) -> [..., in]."""
    *lead, half = packed.shape
    k = 2 * half if in_features is None else in_features
    ng = -(-k // group)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, 2 * half)
    vals = torch.nn.functional.pad(e2m1_decode(codes), (0, ng * group - 2 * half))
    vals = vals.reshape(*lead, ng, group) * e8m0_decode(scale).unsqueeze(-1)
    return vals.reshape(*lead, ng * group)[..., :k].to(out_dtype)


# --------------------------------------------------------------------------- fp8 block
def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] -> zero-padded [ceil(out/R), R, ceil(in/C), C]."""
    (r, c), (o, i) = block, x.shape
    nr, nc = -(-o // r), -(-i // c)
    x = torch.nn.functional.pad(x, (0, nc * c - i, 0, nr * r - o))
    return x.reshape(nr, r, nc, c)


def fp8_block_encode(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn [out, in], scale_inv float32 [ceil(out/R), ceil(in/C)])."""
    w = _check_finite("fp8_block_encode", w)
    if w.dim() != 2:
        raise ValueError(f"fp8_block_encode: want a 2-D [out, in] weight, got {tuple(w.shape)}")
    b = _blocks(w, block)
    amax = b.abs().amax(dim=(1, 3))
    exp = torch.where(amax == 0, torch.zeros_like(amax, dtype=torch.int32),
                      _pow2_exponent(amax, FP8_MAX)).clamp(-126, 127)
    scale_inv = torch.ldexp(torch.ones_like(amax), exp)
    q = (b / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(b.shape[0] * block[0], -1)[: w.shape[0], : w.shape[1]]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv


def fp8_block_decode(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8_e4m3fn [out, in], float32 [ceil(out/R), ceil(in/C)]) -> [out, in], in fp32 then cast."""
    o, i = q.shape
    b = _blocks(q.float(), block) * scale_inv.float()[:, None, :, None]
    return b.reshape(b.shape[0] * block[0], -1)[:o, :i].to(out_dtype)


# --------------------------------------------------------------------------- detection + load
@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One linear weight as stored: its format, logical [out, in] shape and raw tensors by suffix
    (kept as read, so a GPU kernel can use the packed form)."""
    prefix: str
    format: WeightFormat
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor] = field(repr=False)
    fp8_block: tuple[int, int] = FP8_BLOCK

    def dequantize(self, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = self.tensors
        if self.format is WeightFormat.PLAIN:
            return t["weight"].to(out_dtype)
        if self.format is WeightFormat.FP8_BLOCK:
            return fp8_block_decode(t["weight"], t["weight_scale_inv"], self.fp8_block, out_dtype)
        return mxfp4_decode(t["weight_packed"], t["weight_scale"], in_features=self.shape[1],
                            out_dtype=out_dtype)


def detect_format(reader, prefix: str) -> WeightFormat:
    """Which format `prefix` is stored in, from the tensor names alone."""
    present = {s for s in WEIGHT_SUFFIXES if f"{prefix}.{s}" in reader}
    for fmt, spec in FORMAT_TENSORS.items():
        if set(spec.required) <= present <= set(spec.required + spec.optional):
            return fmt
    if not present:  # a miss, not a malformed entry: KeyError-style, like reader.get
        where = getattr(reader, "dir", "the checkpoint")
        raise MissingTensorError(f"no weight for {prefix!r}: none of {prefix}.weight, "
                                 f"{prefix}.weight_packed is in {where}")
    known = "; ".join(f"{f.value}: {' + '.join(s.required)}" for f, s in FORMAT_TENSORS.items())
    raise CheckpointError(f"{prefix!r} has tensors {sorted(present)}, which match no single "
                          f"weight format (known: {known})")


def _expect(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise CheckpointError(f"{name}: {what}")


def inspect_linear_weight(reader, prefix: str, *, fp8_block: tuple[int, int] = FP8_BLOCK,
                          group: int = MXFP4_GROUP) -> tuple[WeightFormat, tuple[int, int], tuple[str, ...]]:
    """`prefix`'s format, logical [out, in] shape and tensor suffixes, checked from the headers
    alone (an optional mxfp4 ``weight_shape``, two integers, is the only tensor read)."""
    fmt = detect_format(reader, prefix)
    n = {s: f"{prefix}.{s}" for s in WEIGHT_SUFFIXES}
    if fmt is WeightFormat.MXFP4:
        pk, sc = reader.shape(n["weight_packed"]), reader.shape(n["weight_scale"])
        _expect(reader.dtype(n["weight_packed"]) == torch.uint8 and len(pk) == 2,
                n["weight_packed"], f"want uint8 [out, in/2], got {reader.dtype(n['weight_packed'])} {list(pk)}")
        out, cols = pk
        k = 2 * cols
        suffixes: tuple[str, ...] = ("weight_packed", "weight_scale")
        if n["weight_shape"] in reader:
            ws = reader.get(n["weight_shape"])
            _expect(ws.dtype in (torch.int32, torch.int64) and ws.shape == (2,), n["weight_shape"],
                    f"want an int tensor [2], got {ws.dtype} {list(ws.shape)}")
            wo, k = (int(v) for v in ws.tolist())
            _expect(wo == out and -(-k // 2) == cols, n["weight_shape"],
                    f"says {[wo, k]}, but {n['weight_packed']} is {list(pk)}")
            suffixes += ("weight_shape",)
        _expect(reader.dtype(n["weight_scale"]) == torch.uint8 and sc == (out, -(-k // group)),
                n["weight_scale"], f"want uint8 [{out}, {-(-k // group)}] (E8M0 per {group} inputs), "
                f"got {reader.dtype(n['weight_scale'])} {list(sc)}")
        return fmt, (out, k), suffixes
    w = reader.shape(n["weight"])
    dt = reader.dtype(n["weight"])
    _expect(len(w) == 2, n["weight"], f"want a 2-D [out, in] weight, got shape {list(w)}")
    if fmt is WeightFormat.FP8_BLOCK:
        want = [-(-w[0] // fp8_block[0]), -(-w[1] // fp8_block[1])]
        _expect(dt == torch.float8_e4m3fn, n["weight"], f"want float8_e4m3fn beside a "
                f"weight_scale_inv, got {dt}")
        s, sdt = reader.shape(n["weight_scale_inv"]), reader.dtype(n["weight_scale_inv"])
        _expect(sdt == torch.float32 and list(s) == want, n["weight_scale_inv"],
                f"want float32 {want} for a {list(w)} weight in {list(fp8_block)} blocks, "
                f"got {sdt} {list(s)}")
        return fmt, (w[0], w[1]), ("weight", "weight_scale_inv")
    _expect(dt.is_floating_point and dt.itemsize >= 2, n["weight"],
            f"want a bf16/fp16/fp32 weight, got {dt} (an fp8 weight needs its weight_scale_inv)")
    return fmt, (w[0], w[1]), ("weight",)


def read_linear_weight(reader, prefix: str, *, expected_shape: Sequence[int] | None = None,
                       fp8_block: tuple[int, int] = FP8_BLOCK,
                       group: int = MXFP4_GROUP) -> QuantizedWeight:
    """Detect `prefix`'s format, check every tensor's dtype and shape from the headers, then read
    (and so consume) exactly that format's tensors."""
    fmt, shape, suffixes = inspect_linear_weight(reader, prefix, fp8_block=fp8_block, group=group)
    tensors = {s: reader.get(f"{prefix}.{s}") for s in suffixes}
    if expected_shape is not None and tuple(expected_shape) != shape:
        raise CheckpointError(f"{prefix}: weight shape {list(shape)} (from {prefix}."
                              f"{next(iter(tensors))}) != expected {list(expected_shape)}")
    return QuantizedWeight(prefix, fmt, shape, tensors, fp8_block)


def load_linear_weight(reader, prefix: str, *, out_dtype: torch.dtype,
                       expected_shape: Sequence[int] | None = None,
                       fp8_block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """The dequantized [out, in] weight of module `prefix`, consuming exactly its tensors."""
    qw = read_linear_weight(reader, prefix, expected_shape=expected_shape, fp8_block=fp8_block)
    return qw.dequantize(out_dtype)


def quantize_for_checkpoint(name: str, weight: torch.Tensor, fmt: WeightFormat | str,
                            *, fp8_block: tuple[int, int] = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one linear weight `name` ("X" or "X.weight") in format `fmt`
    ("plain" | "fp8" | "mxfp4"): {"X.weight": w} | {"X.weight", "X.weight_scale_inv"} |
    {"X.weight_packed", "X.weight_scale"}. Plain weights are stored unchanged."""
    prefix = name.removesuffix(".weight")
    fmt = WeightFormat(fmt)
    if weight.dim() != 2:
        raise ValueError(f"{name}: want a 2-D [out, in] weight, got {tuple(weight.shape)}")
    if fmt is WeightFormat.PLAIN:
        return {f"{prefix}.weight": weight}
    if fmt is WeightFormat.FP8_BLOCK:
        q, s = fp8_block_encode(weight, fp8_block)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s}
    p, s = mxfp4_encode(weight)
    return {f"{prefix}.weight_packed": p, f"{prefix}.weight_scale": s}


# --------------------------------------------------------------------------- config.json
def fp8_quantization_config(block: tuple[int, int] = FP8_BLOCK) -> dict:
    """DeepSeek-V3's `quantization_config`."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


def mxfp4_quantization_config(ignore: Sequence[str] = ()) -> dict:
    """compressed-tensors `quantization_config` for MXFP4 weights (W4A16 as stored: activation
    precision is the engine's choice). `ignore` holds module names or "re:<regex>" patterns
    (matched with re.match) of Linear modules left unquantized."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
               "group_size": MXFP4_GROUP, "dynamic": False, "scale_dtype": "torch.uint8",
               "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}, "zp_dtype": None}
    return {"quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {"format": MXFP4_FORMAT, "targets": ["Linear"],
                                          "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": list(ignore)}


@dataclass(frozen=True)
class QuantizationSpec:
    """A checkpoint's `quantization_config`, validated. method: "none" | "fp8" | "mxfp4"."""
    method: str = "none"
    fp8_block: tuple[int, int] = FP8_BLOCK
    group_size: int = MXFP4_GROUP
    ignore: tuple[str, ...] = ()

    def is_ignored(self, module: str) -> bool:
        """compressed-tensors' rule: "re:" entries re.match the module name, others equal it."""
        return any(re.match(p[3:], module) if p.startswith("re:") else p == module
                   for p in self.ignore)


def parse_quantization_config(qc: dict | None) -> QuantizationSpec:
    """Validate a `quantization_config` against the formats this module decodes; errors name
    the offending field."""
    if not qc:
        return QuantizationSpec()

    def want(path: str, got, expected) -> None:
        if got != expected:
            raise ValueError(f"quantization_config.{path}: expected {expected!r}, got {got!r}")

    method = qc.get("quant_method")
    if method == "fp8":
        want("fmt", qc.get("fmt", "e4m3"), "e4m3")
        want("activation_scheme", qc.get("activation_scheme", "dynamic"), "dynamic")
        blk = qc.get("weight_block_size")
        if not (isinstance(blk, list) and len(blk) == 2 and all(isinstance(b, int) and b > 0 for b in blk)):
            raise ValueError(f"quantization_config.weight_block_size: expected [rows, cols], got {blk!r}")
        return QuantizationSpec("fp8", fp8_block=(blk[0], blk[1]))
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups: missing or empty")
        for gname, g in groups.items():
            path = f"config_groups.{gname}"
            want(f"{path}.format", g.get("format") or qc.get("format"), MXFP4_FORMAT)
            w = g.get("weights") or {}
            for key, val in (("num_bits", 4), ("type", "float"), ("strategy", "group"),
                             ("group_size", MXFP4_GROUP)):
                want(f"{path}.weights.{key}", w.get(key), val)
        ignore = qc.get("ignore") or []
        if not (isinstance(ignore, list) and all(isinstance(p, str) for p in ignore)):
            raise ValueError(f"quantization_config.ignore: expected a list of strings, got {ignore!r}")
        return QuantizationSpec("mxfp4", ignore=tuple(ignore))
    raise ValueError(f"quantization_config.quant_method: unsupported {method!r} "
                     "(supported: 'fp8', 'compressed-tensors' mxfp4-pack-quantized)")
