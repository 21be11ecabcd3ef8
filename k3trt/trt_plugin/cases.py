"""The plugin contract as test cases: per k3trt ONNX op, fresh random inputs at a named size, the
node's attributes, and the plain-torch reference the plugin must match (the op's own reference in
k3trt/plugins/ or export.py). tests/trt_plugin/test_trt_plugin.py checks the build-phase shapes and dtypes on
the CPU; tests/trt_plugin/test_trt_plugin_gpu.py runs every case through the harness on a GPU.

Sizes: "tiny" (the tiny preset's dims) and "k3" (K3's per-layer dims: 96 heads, latent 512 + 64
rope, page 64, KDA 96 x 128, routed experts 3584 -> 3072, top-16, SiTU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import k3trt.builder.export  # noqa: F401  (registers the export-only wrapper ops)
from k3trt.plugins.cache_write_ref import mla_cache_write_reference
from k3trt.plugins.dcp import local_len
from k3trt.plugins.kda_ref import kda_chunked_reference, kda_recurrent_reference, short_conv_reference
from k3trt.plugins.merge_ref import merge_attn_states_ref
from k3trt.plugins.mla_verify_ref import mla_verify_ref

FP8 = torch.float8_e4m3fn


@dataclass
class Case:
    name: str
    op: str
    inputs: list[torch.Tensor]
    attrs: dict[str, Any]
    reference: Callable[[], list[torch.Tensor]]
    # tolerances: k3trt.testing.TOLERANCES by each output's dtype, overridden per output dtype here
    tol: dict[torch.dtype, dict[str, float]] = field(default_factory=dict)
    exact: bool = False                             # bitwise equal (copies and conversions)


def _rand(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen, device="cpu") * scale).to(dtype).to(device)


def _nan_fill(t: torch.Tensor) -> None:
    if t.dtype == FP8:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))


# ------------------------------------------------------------------------------ MLA
def mla_verify(size: str, dtype, device, gen, *, kv_dtype=None, dcp=(1, 0, 1), sparse=(0, 1, 1, 1)) -> Case:

    B, Q, H, d_v, rope, page, lens = {
        "tiny": (3, 2, 4, 64, 16, 16, (1, 20, 45)),
        "k3": (4, 4, 96, 512, 64, 64, (3, 300, 1500, 4097)),
    }[size]
    D, kv_dtype = d_v + rope, kv_dtype or dtype
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    size_, rank, inter = dcp
    local = [local_len(n, size_, rank, inter) for n in lens]
    pages_per = [max(-(-n // page), 1) for n in local]
    max_blocks = max(pages_per) + 1
    num_blocks = sum(pages_per) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(B, max_blocks, dtype=torch.int32)
    cache = torch.randn(num_blocks, page, D, generator=gen) / kv_scale
    cache = cache.to(kv_dtype)
    used = torch.zeros(num_blocks * page, dtype=torch.bool)
    start = 0
    for b in range(B):
        ids = perm[start:start + pages_per[b]]
        start += pages_per[b]
        table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for i in range(local[b]):
            used[ids[i // page] * page + i % page] = True
    flat = cache.view(-1, D)
    spare = flat[~used]
    _nan_fill(spare)                                 # slots past a length must never be read
    flat[~used] = spare
    q = _rand(gen, (B * Q, H, D), dtype, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    inputs = [q, cache.to(device), table.to(device), seq_lens.to(device)]
    chunk, sink, stride, recent = sparse
    attrs = {"q_per_req": Q, "softmax_scale": (128 + rope) ** -0.5, "kv_scale": kv_scale, "d_v": d_v, "dcp_size": size_,
                 "dcp_rank": rank, "dcp_interleave": inter, "sparse_chunk": chunk, "sparse_sink": sink,
                 "sparse_stride": stride, "sparse_recent": recent}
    name = f"{size}-{dtype}-{kv_dtype}-dcp{dcp}-sparse{sparse}"
    return Case(name, "MlaVerify", inputs, attrs, lambda: list(mla_verify_ref(*inputs, **attrs)))


def mla_cache_write(size: str, dtype, device, gen, *, cache_dtype=None) -> Case:

    T, R, P, blocks, page = {"tiny": (7, 64, 16, 4, 16), "k3": (64, 512, 64, 40, 64)}[size]
    cache_dtype = cache_dtype or dtype
    kv_scale = 0.5 if cache_dtype == FP8 else 1.0
    slots = torch.randperm(blocks * page, generator=gen)[:T]
    slots[::3] = -1                                  # padding tokens
    inputs = [_rand(gen, (T, R), dtype, device), _rand(gen, (T, P), dtype, device),
              _rand(gen, (blocks, page, R + P), cache_dtype, device), slots.to(device)]

    def reference():
        out = inputs[2].clone()
        mla_cache_write_reference(inputs[0], inputs[1], out, inputs[3], kv_scale)
        return [out]
    return Case(f"{size}-{dtype}-{cache_dtype}", "MlaCacheWrite", inputs, {"kv_scale": kv_scale}, reference,
                exact=True)


def merge_attn_states(size: str, dtype, device, gen) -> Case:

    T, H, d_v = {"tiny": (6, 4, 32), "k3": (128, 96, 512)}[size]
    out_a, out_b = _rand(gen, (T, H, d_v), dtype, device), _rand(gen, (T, H, d_v), dtype, device)
    lse_a, lse_b = _rand(gen, (T, H), torch.float32, device, 3.0), _rand(gen, (T, H), torch.float32, device, 3.0)
    lse_a[0], out_a[0] = float("-inf"), float("nan")      # a side that saw nothing: its out is garbage
    lse_b[1], out_b[1] = float("-inf"), float("nan")
    lse_a[2], lse_b[2] = float("-inf"), float("-inf")     # neither side saw anything
    inputs = [out_a, lse_a, out_b, lse_b]
    return Case(f"{size}-{dtype}", "MergeAttnStates", inputs, {}, lambda: list(merge_attn_states_ref(*inputs)))


# ------------------------------------------------------------------------------ KDA
def _kda_inputs(B, T, H, dk, dv, dtype, device, gen):
    lead = (B, T) if B else (T,)
    q = F.normalize(torch.randn(*lead, H, dk, generator=gen), dim=-1).to(dtype).to(device)
    k = F.normalize(torch.randn(*lead, H, dk, generator=gen), dim=-1).to(dtype).to(device)
    v = _rand(gen, (*lead, H, dv), dtype, device)
    g = F.logsigmoid(torch.randn(*lead, H, dk, generator=gen) * 2 + 2).to(device)      # <= 0, fp32
    beta = torch.sigmoid(torch.randn(*lead, H, generator=gen)).to(dtype).to(device)
    state = (torch.randn(*((B,) if B else ()), H, dk, dv, generator=gen) * 0.1).to(device)
    return [q, k, v, g, beta, state]


def kda_recurrent(size: str, dtype, device, gen, *, save_all=True, batched=True) -> Case:

    B, T, H, dk, dv = {"tiny": (2, 3, 2, 32, 32), "k3": (8, 4, 96, 128, 128)}[size]
    inputs = _kda_inputs(B if batched else 0, T, H, dk, dv, dtype, device, gen)
    attrs = {"scale": dk ** -0.5, "save_all": int(save_all)}

    def ref():
        return list(kda_recurrent_reference(*inputs, attrs["scale"], save_all))

    return Case(f"{size}-{dtype}-save{int(save_all)}-b{int(batched)}", "KdaRecurrent", inputs, attrs, ref)


def kda_chunked(size: str, dtype, device, gen, *, batched=False) -> Case:

    B, T, H, dk, dv, chunk = {"tiny": (2, 20, 2, 32, 32, 8), "k3": (1, 256, 96, 128, 128, 64)}[size]
    inputs = _kda_inputs(B if batched else 0, T, H, dk, dv, dtype, device, gen)
    attrs = {"scale": dk ** -0.5, "chunk_size": chunk}

    def ref():
        return list(kda_chunked_reference(*inputs, attrs["scale"], chunk))

    # the plugin runs the recurrence: equal to the chunked form up to fp32 rounding
    return Case(f"{size}-{dtype}-b{int(batched)}", "KdaChunked", inputs, attrs, ref,
                tol={torch.float32: {"atol": 1e-4, "rtol": 1e-3, "rel_norm": 1e-4}})


def short_conv(size: str, dtype, device, gen, *, save_all=True, batched=True, state_dtype=torch.float32) -> Case:

    B, T, C, K = {"tiny": (2, 5, 64, 4), "k3": (8, 4, 96 * 128, 4)}[size]
    lead = (B, T) if batched else (T,)
    inputs = [_rand(gen, (*lead, C), dtype, device), _rand(gen, (C, 1, K), dtype, device, 0.5),
              _rand(gen, (*((B,) if batched else ()), C, K - 1), state_dtype, device)]

    def ref():
        return list(short_conv_reference(*inputs, save_all))

    return Case(f"{size}-{dtype}-{state_dtype}-save{int(save_all)}-b{int(batched)}", "ShortConv", inputs,
                {"save_all": int(save_all)}, ref)


# ------------------------------------------------------------------------------ MoE
def moe_experts(size: str, dtype, device, gen, *, activation="situ") -> Case:
    T, W, I, E, k = {"tiny": (5, 64, 32, 8, 2), "k3": (8, 3584, 3072, 32, 16)}[size]
    beta, linear_beta = (4.0, 25.0) if activation == "situ" else (0.0, 0.0)
    scores = torch.randn(T, E, generator=gen)
    top = scores.topk(k, dim=-1)
    inputs = [_rand(gen, (T, W), dtype, device), top.indices.to(device),
              torch.softmax(top.values, -1).to(device),
              _rand(gen, (E, I, W), dtype, device, W ** -0.5), _rand(gen, (E, I, W), dtype, device, W ** -0.5),
              _rand(gen, (E, W, I), dtype, device, I ** -0.5)]
    attrs = {"activation": activation, "beta": beta, "linear_beta": linear_beta}

    def ref():
        return [torch.ops.k3trt.moe_experts(*inputs, activation, beta, linear_beta)]

    return Case(f"{size}-{dtype}-{activation}", "MoeExperts", inputs, attrs, ref)


def all_cases(size: str, device, seed: int = 0) -> list[Case]:
    """Every op's cases at `size` on `device`: each dtype the op takes, fp8 caches, DCP and the sparse
    policy (tiny), save_all on and off, batched and single sequences."""
    gen = torch.Generator().manual_seed(seed)
    bf16, f32 = torch.bfloat16, torch.float32
    cases = [mla_verify(size, bf16, device, gen), mla_verify(size, bf16, device, gen, kv_dtype=FP8),
             mla_verify(size, torch.float16, device, gen),
             mla_cache_write(size, bf16, device, gen), mla_cache_write(size, bf16, device, gen, cache_dtype=FP8),
             mla_cache_write(size, f32, device, gen),
             merge_attn_states(size, bf16, device, gen), merge_attn_states(size, f32, device, gen),
             kda_recurrent(size, bf16, device, gen), kda_recurrent(size, f32, device, gen, save_all=False),
             kda_recurrent(size, f32, device, gen, batched=False),
             kda_chunked(size, f32, device, gen), kda_chunked(size, bf16, device, gen, batched=True),
             short_conv(size, bf16, device, gen), short_conv(size, f32, device, gen, save_all=False, batched=False),
             short_conv(size, bf16, device, gen, state_dtype=bf16),
             moe_experts(size, bf16, device, gen), moe_experts(size, f32, device, gen, activation="silu")]
    if size == "tiny":
        cases += [mla_verify(size, f32, device, gen), mla_verify(size, bf16, device, gen, dcp=(2, 1, 2)),
                  mla_verify(size, bf16, device, gen, sparse=(16, 1, 2, 1))]
    return cases
