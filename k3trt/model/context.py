"""The per-step context and the cache tensors the model reads and writes.

The model works on a flat token layout: one step holds S sequences, sequence i contributing
``q_lens[i]`` new tokens after ``ctx_lens[i]`` tokens already in its caches; the T = sum(q_lens)
tokens lie in sequence order. Everything about the step travels in one ``StepContext`` (not
through every forward()), and the caches are explicit arguments owned by the caller.

Layouts (public: the runtime, the builder and the plugins rely on them):
  MLA cache, per MLA layer:  [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                              row = [kv_c_normed | k_pe]; bf16/fp32, or float8_e4m3fn with
                              value = fp8 · kv_scale (one per-tensor scale for the whole cache)
  slot_mapping[t]            physical row (block · block_size + offset) token t is written to
  block_table[i, j]          physical block of the j-th logical block of sequence i (int32)
  KDA state, per KDA layer:  [num_slots, heads, head_dim(k), head_dim(v)] fp32
  KDA conv window:           [num_slots, 3 · heads · head_dim, kernel - 1] (q|k|v channels, oldest first)
  KDA step states:           [num_slots, max_q, ...] the state after each of a step's positions,
                              kept when ``save_kda_states`` (speculative verification rolls back to one)
  ModelCache.allocate lays each of these out once for every KDA layer, layer first (``KDAStack``),
  and each layer's tensors are views of it, so a rollback or slot copy over all layers is a few
  kernels (per-layer tensors need 4 a layer: 280 for K3's 70 KDA layers, each on the critical path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3trt.config import ModelConfig
from k3trt.plugins.kda_restore import kda_restore


@dataclass(frozen=True)
class StepContext:
    q_lens: tuple[int, ...]          # new tokens per sequence this step
    ctx_lens: tuple[int, ...]        # tokens already cached per sequence (position of its first new token)
    slot_mapping: torch.Tensor       # int64 [T]
    block_table: torch.Tensor        # int32 [S, max_blocks]
    kda_slots: torch.Tensor          # int64 [S]
    save_kda_states: bool = False    # keep the KDA state after every position (verification)
    # Device copies of what the host tuples imply. A step replayed from a CUDA graph sets them: its
    # host tuples then describe only the padded shape, and reading them would bake one step's
    # lengths into the graph. None: derived from the tuples on demand.
    dev_positions: torch.Tensor | None = None   # int64 [T]
    dev_seq_lens: torch.Tensor | None = None    # int32 [S]
    dev_fresh: torch.Tensor | None = None       # bool [S]: the sequence starts here (ctx_len == 0)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def uniform_q(self) -> int | None:
        """Q when every sequence brings the same number of tokens (decode: 1, verify: K+1)."""
        # equality, not a set: under torch.export a length may be a SymInt, which cannot be hashed
        return self.q_lens[0] if self.q_lens and all(n == self.q_lens[0] for n in self.q_lens) else None

    @property
    def cu_q(self) -> list[int]:
        out = [0]
        for n in self.q_lens:
            out.append(out[-1] + n)
        return out

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every new token (int64 [T])."""
        if self.dev_positions is not None:
            return self.dev_positions
        return torch.cat([torch.arange(c, c + n) for c, n in zip(self.ctx_lens, self.q_lens)]).to(device) \
            if self.q_lens else torch.empty(0, dtype=torch.long, device=device)

    def seq_lens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Total length per sequence after this step's tokens are written (int32 [S])."""
        if self.dev_seq_lens is not None:
            return self.dev_seq_lens
        return torch.tensor([c + n for c, n in zip(self.ctx_lens, self.q_lens)], dtype=torch.int32).to(device)

    def fresh(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [S]: which sequences start in this step (their recurrent state begins at zero)."""
        if self.dev_fresh is not None:
            return self.dev_fresh
        return torch.tensor([c == 0 for c in self.ctx_lens], dtype=torch.bool).to(device)


@dataclass
class KDALayerCache:
    state: torch.Tensor                       # fp32 [slots, H, dk, dv]
    conv: torch.Tensor                        # [slots, 3·H·dk, kernel-1]
    step_state: torch.Tensor | None = None    # fp32 [slots, max_q, H, dk, dv]
    step_conv: torch.Tensor | None = None     # [slots, max_q, 3·H·dk, kernel-1]


@dataclass
class KDAStack:
    """Every KDA layer's tensors of one kind in one tensor, layer first: [layers, num_slots, ...]."""
    state: torch.Tensor
    conv: torch.Tensor
    step_state: torch.Tensor | None = None
    step_conv: torch.Tensor | None = None

    def layer(self, j: int) -> KDALayerCache:
        return KDALayerCache(self.state[j], self.conv[j], None if self.step_state is None else self.step_state[j],
                             None if self.step_conv is None else self.step_conv[j])


@dataclass
class ModelCache:
    """Every cache tensor of one model instance, indexed by layer number."""
    block_size: int
    mla: dict[int, torch.Tensor] = field(default_factory=dict)        # layer -> [blocks, bs, D]
    kda: dict[int, KDALayerCache] = field(default_factory=dict)       # layer -> state tensors
    kv_scale: float = 1.0
    kda_stack: KDAStack | None = None     # what the kda entries are views of, in their order

    def _stack(self, what: str) -> KDAStack | None:
        if self.kda_stack is None and self.kda:
            raise ValueError(f"ModelCache.{what}: this cache's KDA layers are not stacked; allocate it with "
                             "ModelCache.allocate, which lays them out as one KDAStack")
        return self.kda_stack

    def restore_kda(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """KDA slot ``slots[i]`` <- its state after position ``positions[i]`` of the last step that
        saved per-position states, in every KDA layer (int64 device tensors; distinct slots)."""
        st = self._stack("restore_kda")
        if st is not None:
            with torch.inference_mode():
                kda_restore(st.state, st.step_state, slots, positions)
                kda_restore(st.conv, st.step_conv, slots, positions)

    def copy_kda(self, src: int, dst: int) -> None:
        """KDA slot ``dst`` <- slot ``src``, in every KDA layer."""
        st = self._stack("copy_kda")
        if st is not None:
            with torch.inference_mode():
                st.state[:, dst].copy_(st.state[:, src])
                st.conv[:, dst].copy_(st.conv[:, src])

    @classmethod
    def allocate(cls, cfg: ModelConfig, *, num_blocks: int, block_size: int, num_slots: int,
                 max_q: int = 0, dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype | None = None, kv_scale: float = 1.0,
                 device: torch.device | str = "cpu", layers: range | None = None) -> "ModelCache":
        """Allocate caches for `layers` (default: every decoder and MTP layer). max_q > 0 also keeps
        per-position KDA states for verification steps of up to max_q tokens."""
        if block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, got {block_size}")
        la = cfg.linear_attn_config
        conv_dim, k = 3 * la.num_heads * la.head_dim, la.short_conv_kernel_size
        cache = cls(block_size=block_size, kv_scale=kv_scale)
        layers = list(layers if layers is not None else range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
        kda = [i for i in layers if cfg.is_kda(i)]
        if kda:
            shape = (len(kda), num_slots, la.num_heads, la.head_dim, la.head_dim)
            conv = (len(kda), num_slots, conv_dim, k - 1)
            cache.kda_stack = KDAStack(
                state=torch.zeros(shape, dtype=torch.float32, device=device),
                conv=torch.zeros(conv, dtype=dtype, device=device),
                step_state=torch.zeros(*shape[:2], max_q, *shape[2:], device=device) if max_q else None,
                step_conv=torch.zeros(*conv[:2], max_q, *conv[2:], dtype=dtype, device=device) if max_q else None)
            cache.kda = {i: cache.kda_stack.layer(j) for j, i in enumerate(kda)}
        for i in layers:
            if not cfg.is_kda(i):
                cache.mla[i] = torch.zeros(num_blocks, block_size, cfg.mla_cache_dim,
                                           dtype=kv_dtype or dtype, device=device)
        return cache
