"""Which slice of each checkpoint tensor a rank holds: a table of data, applied by the loader
(``k3trt.model.weights.load_weights(..., pc)``) so that each rank copies only its slice out of the
memory-mapped checkpoint.

A rule is (regex over the MODEL parameter name, group, dim): the full tensor is cut into
``pc.size(group)`` equal pieces along `dim` and the rank keeps piece ``pc.index(group)``;
group None means replicated. The first match wins; a parameter that matches no rule is an error
(a new parameter must be placed deliberately). Stacked experts ``[E, ...]`` split along dim 0 over
"ep" mean a contiguous range of experts: the loader then reads only those experts' tensors.

Column-parallel (dim 0 of an [out, in] weight) and row-parallel (dim 1) pairs, per layer:
  MLA   q_b_proj | q_proj, kv_b_proj, g_proj: heads (dim 0)      o_proj: dim 1, then all-reduce
  KDA   q/k/v_proj, q/k/v_conv1d, f_b_proj, g_proj | g_b_proj, b_proj, A_log, dt_bias: heads
        o_proj: dim 1, then all-reduce
  MLP   dense and shared experts: gate_proj, up_proj dim 0; down_proj dim 1, then all-reduce
  head  lm_head: vocab (dim 0), logits all-gathered
Replicated: the embedding (a lookup costs nothing; vocab-parallel would add an all-reduce of
[T, hidden]), the latent projections (fused_qkv_a_proj, kv_a_proj_with_mqa, f_a_proj,
g_a_proj: small, and their outputs are needed whole by every head), the router, every norm and
AttnRes projection, routed_expert_down/up_proj (the latent RMSNorm needs whole rows), eh_proj.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3trt.parallel.config import ParallelConfig

_L = r"model\.layers\.\d+\."
_ATTN = _L + r"self_attn\."

# (regex over the model parameter name, group or None (replicated), dim)
SHARD_RULES: tuple[tuple[str, str | None, int | None], ...] = (
    (r"lm_head\.weight", "tp", 0),
    (_ATTN + r"(q_proj|q_b_proj|kv_b_proj|g_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj)\.weight", "tp", 0),
    (_ATTN + r"[qkv]_conv1d\.weight", "tp", 0),
    (_ATTN + r"(A_log|dt_bias)", "tp", 0),
    (_ATTN + r"o_proj\.weight", "tp", 1),
    (_L + r"mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight", "tp", 0),
    (_L + r"mlp\.(shared_experts\.)?down_proj\.weight", "tp", 1),
    (_L + r"mlp\.experts\.w_(gate|up|down)", "ep", 0),
    (r"model\.embed_tokens\.weight", None, None),
    (r".*norm\.weight", None, None),
    (r".*_res_proj\.weight", None, None),
    (_ATTN + r"(fused_qkv_a_proj|kv_a_proj_with_mqa|f_a_proj|g_a_proj)\.weight", None, None),
    (_L + r"mlp\.gate\.(weight|e_score_correction_bias)", None, None),
    (_L + r"mlp\.routed_expert_(down|up)_proj\.weight", None, None),
    (_L + r"eh_proj\.weight", None, None),
    (r"vision\..+", None, None),           # the vision encoder is small: every rank holds all of it
)


class ShardError(ValueError):
    """A parameter the sharding table does not place, or a shape that does not split."""


@dataclass(frozen=True)
class Part:
    """Piece `index` of `count` equal pieces along `dim` of the full tensor (dim None: all of it)."""
    dim: int | None = None
    index: int = 0
    count: int = 1

    def full_shape(self, local: torch.Size) -> torch.Size:
        if self.dim is None:
            return torch.Size(local)
        return torch.Size(n * self.count if d == self.dim else n for d, n in enumerate(local))

    def range(self, full: int) -> range:
        """The indices along `dim` this piece covers, of `full`."""
        n = full // self.count
        return range(self.index * n, (self.index + 1) * n)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of the full tensor `t`, as a view (nothing is read yet from a mmap)."""
        if self.dim is None or self.count == 1:
            return t
        r = self.range(t.shape[self.dim])
        return t.narrow(self.dim, r.start, len(r))


WHOLE = Part()


def param_part(name: str, pc: ParallelConfig) -> Part:
    """The piece of checkpoint tensor(s) behind model parameter `name` that rank `pc.rank` holds."""
    for pattern, group, dim in SHARD_RULES:
        if re.fullmatch(pattern, name):
            if group is None or pc.size(group) == 1:
                return WHOLE
            return Part(dim, pc.index(group), pc.size(group))
    raise ShardError(f"parameter '{name}' matches no rule of k3trt.parallel.shard.SHARD_RULES; "
                     "add one (split over a group along a dim, or replicated)")
