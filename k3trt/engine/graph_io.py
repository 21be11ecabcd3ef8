"""The I/O contract of each per-capacity step graph: what the builder exports and the runtime binds.

Two graphs per capacity, both static-shaped in their step dimensions:

    verify_b{B}    B requests x Q = K+1 rows each (decode is verify with Q rows too): logits of
                   every row; KDA states after every row are saved (speculative rollback).
    prefill_t{T}   T new tokens of ONE sequence: logits of the last token. No padding: a chunk of
                   n tokens runs as the exact sum of power-of-two capacities
                   (``Capacities.split_prefill``), because KDA's recurrence cannot skip padded
                   tokens (they would advance the state and the conv window).

Graph inputs (names are the engine bindings; ``io_specs`` lists them with shapes and dtypes):
    input_ids int64 [N], slot_mapping int64 [N] (negative: do not write), block_table int32
    [S, max_blocks], seq_lens int32 [S] (cached length after this step's rows, as mla_verify
    wants), kda_slots int64 [S], positions int64 [N] (only for RoPE MLA layers; K3's are NoPE),
    image_embeds [N, hidden] in the model dtype and image_mask bool [N] (only prefill graphs of an
    engine built with encoder capacities: rows where the mask is set take image_embeds in place of
    the token embedding; the onnx backend's image prompts), then the caches: mla_cache_{l}
    [num_blocks, block_size, D]; kda_state_{l} [num_slots, H, dk, dv] fp32, kda_conv_{l}
    [num_slots, C, K-1]; verify also kda_step_state_{l} [num_slots, Q, H, dk, dv] and
    kda_step_conv_{l} [num_slots, Q, C, K-1]. num_blocks and num_slots are dynamic (DYNAMIC_DIMS).
Graph outputs: logits fp32, then every cache again as ``<name>_out``: the graph is functional
(ONNX has no in-place update). An engine binds ``<name>_out`` to the same memory as ``<name>``
only where the producing node supports it (a plugin declaring the alias, as MlaCacheWrite
should); a native ScatterND output is a copy, which is what the KDA state updates are for now.

Contract the caller keeps (the model's ctx_len == 0 rule lives outside the graph): a sequence
that starts fresh must have its KDA state and conv window zeroed before its first chunk; the
graph always continues from the slot's contents. Padded verify requests point kda_slots at a
scratch slot, slot_mapping at -1 and seq_lens at Q; a live request with fewer than Q rows is
padded at its end (slot -1, seq_lens = context + Q) and its KDA state is then reset to the one
saved after its last live row (runtime/engine_io.py: CapacitySession does all of this).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from k3trt.config import ModelConfig
from k3trt.engine.capacities import Capacities

DYNAMIC_DIMS = ("num_blocks", "num_slots")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str, ...]     # str: a dynamic dimension (DYNAMIC_DIMS)
    dtype: torch.dtype


@dataclass(frozen=True)
class GraphSpec:
    kind: str                        # "verify" | "prefill"
    capacity: int                    # verify: requests B; prefill: tokens T
    q_per_req: int                   # verify: K+1; prefill: T
    block_size: int
    max_blocks: int                  # block-table width: ceil((max_seq_len + K) / block_size)
    dtype: torch.dtype               # weights and activations
    kv_dtype: torch.dtype
    kv_scale: float = 1.0
    image_embeds: bool = False       # prefill: takes image_embeds / image_mask (module doc)

    def __post_init__(self) -> None:
        if self.kind not in ("verify", "prefill"):
            raise ValueError(f"graph kind {self.kind!r}: choose verify or prefill")
        if self.kind == "prefill" and self.q_per_req != self.capacity:
            raise ValueError(f"a prefill graph runs one sequence: q_per_req must equal the capacity {self.capacity}")

    @classmethod
    def verify(cls, batch: int, spec_tokens: int, **kw) -> "GraphSpec":
        return cls("verify", batch, spec_tokens + 1, **kw)

    @classmethod
    def prefill(cls, tokens: int, **kw) -> "GraphSpec":
        return cls("prefill", tokens, tokens, **kw)

    @property
    def name(self) -> str:
        return f"verify_b{self.capacity}" if self.kind == "verify" else f"prefill_t{self.capacity}"

    @property
    def num_seqs(self) -> int:
        return self.capacity if self.kind == "verify" else 1

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.q_per_req

    @property
    def saves_kda_states(self) -> bool:
        return self.kind == "verify"

    @property
    def logit_rows(self) -> int:
        return self.num_tokens if self.kind == "verify" else 1


def uses_rope(cfg: ModelConfig) -> bool:
    return not cfg.mla_use_nope and bool(cfg.mla_layers)


def cache_specs(cfg: ModelConfig, spec: GraphSpec) -> list[TensorSpec]:
    la = cfg.linear_attn_config
    H, D, conv = la.num_heads, la.head_dim, (3 * la.num_heads * la.head_dim, la.short_conv_kernel_size - 1)
    out = []
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_kda(layer):
            out.append(TensorSpec(f"mla_cache_{layer}", ("num_blocks", spec.block_size, cfg.mla_cache_dim),
                                  spec.kv_dtype))
            continue
        out += [TensorSpec(f"kda_state_{layer}", ("num_slots", H, D, D), torch.float32),
                TensorSpec(f"kda_conv_{layer}", ("num_slots", *conv), spec.dtype)]
        if spec.saves_kda_states:
            out += [TensorSpec(f"kda_step_state_{layer}", ("num_slots", spec.q_per_req, H, D, D), torch.float32),
                    TensorSpec(f"kda_step_conv_{layer}", ("num_slots", spec.q_per_req, *conv), spec.dtype)]
    return out


def io_specs(cfg: ModelConfig, spec: GraphSpec) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the graph, in binding order."""
    N, S = spec.num_tokens, spec.num_seqs
    ins = [TensorSpec("input_ids", (N,), torch.int64), TensorSpec("slot_mapping", (N,), torch.int64),
           TensorSpec("block_table", (S, spec.max_blocks), torch.int32), TensorSpec("seq_lens", (S,), torch.int32),
           TensorSpec("kda_slots", (S,), torch.int64)]
    if uses_rope(cfg):
        ins.append(TensorSpec("positions", (N,), torch.int64))
    if spec.image_embeds:
        ins += [TensorSpec("image_embeds", (N, cfg.hidden_size), spec.dtype), TensorSpec("image_mask", (N,), torch.bool)]
    caches = cache_specs(cfg, spec)
    outs = [TensorSpec("logits", (spec.logit_rows, cfg.vocab_size), torch.float32)]
    outs += [dataclasses.replace(c, name=f"{c.name}_out") for c in caches]
    return ins + caches, outs


def graph_specs(cfg: ModelConfig, capacities: Capacities, *, block_size: int, max_seq_len: int, dtype: torch.dtype,
                kv_dtype: torch.dtype, kv_scale: float = 1.0) -> list[GraphSpec]:
    """The GraphSpecs of every capacity (verify first), as the engine dir names them; the prefill
    graphs take image embeddings when the model has a vision tower and encoder capacities."""
    # a padded verify request sees up to Q - 1 rows past its last live one
    max_blocks = -(-(max_seq_len + capacities.spec_tokens) // block_size)
    kw = dict(block_size=block_size, max_blocks=max_blocks, dtype=dtype, kv_dtype=kv_dtype, kv_scale=kv_scale)
    return ([GraphSpec.verify(b, capacities.spec_tokens, **kw) for b in capacities.verify] +
            [GraphSpec.prefill(t, image_embeds=bool(capacities.encoder) and cfg.vision is not None, **kw)
             for t in capacities.prefill])
