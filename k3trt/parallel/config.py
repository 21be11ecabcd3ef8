"""``ParallelConfig``: how one model instance is spread over ranks, checked against the model.

Three sizes, each dividing the world size ``max(tp, dcp, ep)``; every group is a contiguous block
of ranks (rank r's TP rank is ``r % tp``, its DCP rank ``r % dcp``, its EP rank ``r % ep``):
  tp   tensor parallel: MLA and KDA heads, the dense MLP and shared experts' intermediate width,
       and lm_head's vocabulary are split; partial outputs are all-reduced (lm_head: gathered).
  dcp  decode context parallel: the MLA cache is split by token (token t on DCP rank
       ``(t // dcp_interleave) % dcp``); attention partials merge by their LSE.
       dcp <= tp is vLLM's layout (the DCP group lies inside the TP group: TP8 + DCP8 is 8 GPUs);
       dcp > tp replicates the TP group dcp / tp times (tp = 1: every rank computes everything
       except attention over its own cache shard).
  ep   expert parallel: routed experts in contiguous ranges, ``ep_rank·E/ep .. (ep_rank+1)·E/ep``.
A size that is smaller than the world size repeats its groups: the replicas compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3trt.config import ModelConfig

GROUPS = ("tp", "dcp", "ep")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run this model; the message names the fields."""


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dcp: int = 1
    ep: int = 1
    dcp_interleave: int = 1    # consecutive tokens per DCP rank before moving to the next
    rank: int = 0              # global rank in [0, world_size)

    def __post_init__(self) -> None:
        for name in (*GROUPS, "dcp_interleave"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"ParallelConfig.{name} must be a positive integer, got {v!r}")
        w = self.world_size
        for name in GROUPS:
            if w % getattr(self, name):
                raise ParallelConfigError(
                    f"ParallelConfig.{name}={getattr(self, name)} does not divide the world size {w} "
                    f"(= max(tp, dcp, ep)); the sizes must nest (e.g. tp=8, dcp=8 or 4 or 2, ep=8)")
        if not 0 <= self.rank < w:
            raise ParallelConfigError(f"ParallelConfig.rank={self.rank} is outside 0..{w - 1}")

    @property
    def world_size(self) -> int:
        return max(self.tp, self.dcp, self.ep)

    def size(self, group: str) -> int:
        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}; groups are {GROUPS}")
        return getattr(self, group)

    def index(self, group: str) -> int:
        """This rank's position in its `group` ("tp" | "dcp" | "ep")."""
        return self.rank % self.size(group)

    @property
    def tp_rank(self) -> int:
        return self.index("tp")

    @property
    def dcp_rank(self) -> int:
        return self.index("dcp")

    @property
    def ep_rank(self) -> int:
        return self.index("ep")

    def group_ranks(self, group: str) -> tuple[int, ...]:
        """The global ranks of this rank's `group`, in group order."""
        n = self.size(group)
        start = self.rank - self.rank % n
        return tuple(range(start, start + n))

    def all_groups(self, group: str) -> list[tuple[int, ...]]:
        """Every `group` of the world (torch.distributed creates each on every rank, in order)."""
        n = self.size(group)
        return [tuple(range(s, s + n)) for s in range(0, self.world_size, n)]

    def with_rank(self, rank: int) -> "ParallelConfig":
        return ParallelConfig(self.tp, self.dcp, self.ep, self.dcp_interleave, rank)

    def validate(self, cfg: ModelConfig, prefix: str = "text_config.") -> None:
        """Raise ParallelConfigError, naming both fields, when `cfg` cannot be split this way."""
        la = cfg.linear_attn_config
        checks = [("tp", "num_attention_heads", cfg.num_attention_heads, "MLA heads")]
        if cfg.kda_layers:
            checks.append(("tp", "linear_attn_config.num_heads", la.num_heads, "KDA heads"))
        if any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
            checks.append(("tp", "intermediate_size", cfg.intermediate_size, "the dense MLP"))
        if cfg.num_shared_experts:
            checks.append(("tp", "moe_intermediate_size·num_shared_experts",
                           cfg.moe_intermediate_size * cfg.num_shared_experts, "the shared experts"))
        if not cfg.tie_word_embeddings:
            checks.append(("tp", "vocab_size", cfg.vocab_size, "lm_head (vocab-parallel)"))
        checks.append(("ep", "num_experts", cfg.num_experts, "routed experts"))
        for group, field, value, what in checks:
            n = self.size(group)
            if value % n:
                raise ParallelConfigError(f"ParallelConfig.{group}={n} does not divide {prefix}{field}={value} "
                                          f"({what} are split over the {group} ranks)")
