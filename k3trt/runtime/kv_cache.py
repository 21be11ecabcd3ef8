"""Cache memory for the hybrid model: paged MLA blocks with prefix caching, and KDA state slots.

MLA layers keep one latent row per token in fixed-size blocks (``ModelCache.mla``); a block pool
hands them out with reference counts. A full block is registered under the hash of its tokens
chained with its predecessor's hash, so a later request with the same prefix reuses it. Freed blocks
keep their hash until the pool needs them again (LRU), which is what makes a later hit possible.

KDA layers keep a recurrent state per request, not per token, so a reused MLA prefix is only half
of a hit: the KDA state at the end of that prefix must come back too. ``KDASlots`` therefore holds,
besides one slot per live request, a few checkpoint slots: copies of a request's KDA state taken
when its cached length sits exactly on a block boundary, keyed by that block's chain hash. A hit
is usable up to the longest checkpointed boundary; without one it is refused (and logged).

The planner turns a memory budget into a block count. Nothing here touches tensors: the engine
session applies the slot copies the cache manager asks for.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from k3trt.config import ModelConfig
from k3trt.runtime.media import media_key

log = logging.getLogger(__name__)


def block_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    """Chain hash of one full block: a collision would silently reuse the wrong cache, so a real
    digest (not Python's hash()). `extra`: the sha256 of the images whose placeholders it holds
    (their ids are all alike)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    h.update(extra)
    return h.digest()


class BlockPool:
    """Reference-counted blocks; zero-ref blocks wait in an LRU queue, hashed ones still hittable."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> tuple[int, bytes | None]:
        """A fresh block (ref 1) and the hash it was evicted from, if any."""
        if not self.free:
            raise RuntimeError("block pool exhausted (the scheduler should have preempted)")
        b, _ = self.free.popitem(last=False)
        evicted = self.hash_of[b]
        if evicted is not None:
            del self.by_hash[evicted]
            self.hash_of[b] = None
        self.ref[b] = 1
        return b, evicted

    def share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released more often than taken"
        if self.ref[b] == 0:
            self.free[b] = None

    def register(self, b: int, h: bytes) -> None:
        if self.hash_of[b] is None and h not in self.by_hash:
            self.hash_of[b], self.by_hash[h] = h, b


class KDASlots:
    """Slots 0..max_live-1 belong to live requests; the rest hold boundary checkpoints (LRU)."""

    def __init__(self, max_live: int, num_checkpoints: int):
        self.max_live, self.num_checkpoints = max_live, num_checkpoints
        self.free = list(range(max_live - 1, -1, -1))
        self.ckpt: OrderedDict[bytes, int] = OrderedDict()
        self.ckpt_free = list(range(max_live + num_checkpoints - 1, max_live - 1, -1))

    @property
    def num_slots(self) -> int:
        return self.max_live + self.num_checkpoints

    def take(self) -> int:
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def lookup(self, h: bytes) -> int | None:
        slot = self.ckpt.get(h)
        if slot is not None:
            self.ckpt.move_to_end(h)
        return slot

    def reserve(self, h: bytes) -> int | None:
        """A checkpoint slot for hash h (evicting the least recently used), or None if disabled."""
        if not self.num_checkpoints or h in self.ckpt:
            return None
        slot = self.ckpt_free.pop() if self.ckpt_free else self.ckpt.popitem(last=False)[1]
        self.ckpt[h] = slot
        return slot

    def drop(self, h: bytes) -> None:
        slot = self.ckpt.pop(h, None)
        if slot is not None:
            self.ckpt_free.append(slot)


@dataclass(frozen=True)
class CachePlan:
    block_size: int
    num_blocks: int
    max_live: int            # KDA slots for requests (= the largest verify capacity)
    num_checkpoints: int     # KDA checkpoint slots for prefix hits
    bytes_per_block: int
    bytes_per_slot: int

    @property
    def num_slots(self) -> int:
        return self.max_live + self.num_checkpoints

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_slots * self.bytes_per_slot


def plan_cache(cfg: ModelConfig, *, budget_bytes: int, block_size: int, max_live: int, max_model_len: int,
               kv_dtype: torch.dtype, state_dtype: torch.dtype, num_checkpoints: int = 0, max_q: int = 0,
               num_blocks: int | None = None) -> CachePlan:
    """Size the pool: KDA slots first (fixed by the batch), the rest of the budget in MLA blocks,
    never more blocks than every live request at max_model_len can use. `num_blocks` overrides."""
    if block_size <= 0 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
    la = cfg.linear_attn_config
    row = cfg.mla_cache_dim * torch.empty(0, dtype=kv_dtype).element_size()
    per_block = len(cfg.mla_layers) * block_size * row
    state = la.num_heads * la.head_dim * la.head_dim * 4
    conv = 3 * la.num_heads * la.head_dim * (la.short_conv_kernel_size - 1) * torch.empty(0, dtype=state_dtype).element_size()
    per_slot = len(cfg.kda_layers) * (state + conv) * (1 + max_q)
    need_one = -(-max_model_len // block_size)
    if num_blocks is None:
        left = budget_bytes - (max_live + num_checkpoints) * per_slot
        num_blocks = max(0, min(left // max(per_block, 1), max_live * need_one + num_checkpoints * 4))
    if num_blocks < need_one:
        slots = (max_live + num_checkpoints) * per_slot
        states = (f"; the KDA states of {max_live + num_checkpoints} slots ({1 + max_q} states each) "
                  f"take {slots / 2**30:.2f} GiB of the {budget_bytes / 2**30:.2f} GiB budget, lower the batch or K"
                  if num_blocks == 0 and slots >= budget_bytes else "")
        raise ValueError(
            f"the cache holds {num_blocks} blocks of {block_size} tokens but one request of max_model_len "
            f"{max_model_len} needs {need_one}: raise the memory budget (kv_cache_memory) or lower max_model_len"
            f"{states}")
    plan = CachePlan(block_size, int(num_blocks), max_live, num_checkpoints, per_block, per_slot)
    log.info("cache plan: %d MLA blocks x %d tokens, %d KDA slots (+%d checkpoints), %.1f MiB",
             plan.num_blocks, block_size, max_live, num_checkpoints, plan.total_bytes / 2**20)
    return plan


class CacheManager:
    """Blocks and KDA slots of live requests. Slot copies (checkpoint saves and restores) are queued
    in ``copies`` as (src, dst) and applied by the engine session, in order, before its next forward."""

    def __init__(self, plan: CachePlan, *, hybrid: bool, prefix_caching: bool):
        self.block_size, self.hybrid, self.prefix_caching = plan.block_size, hybrid, prefix_caching
        self.pool = BlockPool(plan.num_blocks)
        self.slots = KDASlots(plan.max_live, plan.num_checkpoints if hybrid and prefix_caching else 0)
        self.copies: list[tuple[int, int]] = []

    @property
    def free_slots(self) -> int:
        return len(self.slots.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req, num_tokens: int) -> bool:
        """Grow req.blocks to cover `num_tokens` tokens; all or nothing."""
        need = self.blocks_for(num_tokens) - len(req.blocks)
        if need > self.pool.num_free:
            return False
        for _ in range(max(need, 0)):
            b, evicted = self.pool.allocate()
            if evicted is not None:
                self.slots.drop(evicted)
            req.blocks.append(b)
        return True

    def admit(self, req) -> None:
        """Give a waiting request its KDA slot and whatever prefix the cache already holds."""
        req.kda_slot = self.slots.take()
        req.num_computed = 0
        if not self.prefix_caching:
            return
        # at least one token must be computed: its logits give the next token
        usable = (len(req.token_ids) - 1) // self.block_size
        self._hash_upto(req, usable)
        matched = 0
        while matched < usable and req.block_hashes[matched] in self.pool.by_hash:
            matched += 1
        hit = matched
        if self.hybrid:
            while hit and req.block_hashes[hit - 1] not in self.slots.ckpt:
                hit -= 1
            if hit < matched:
                log.info("request %s: prefix hit cut from %d to %d tokens: no KDA state checkpoint at a "
                         "later block boundary", req.request_id, matched * self.block_size, hit * self.block_size)
            if hit:
                self.copies.append((self.slots.lookup(req.block_hashes[hit - 1]), req.kda_slot))
        for h in req.block_hashes[:hit]:
            b = self.pool.by_hash[h]
            self.pool.share(b)
            req.blocks.append(b)
        req.num_registered, req.num_computed = hit, hit * self.block_size
        req.stats.cached_tokens = req.num_computed

    def commit(self, req, reserve: int = 0) -> None:
        """After a step: register the request's newly full blocks, checkpoint its KDA state if it
        sits on a block boundary, and return blocks past its cached length (rejected drafts) plus
        `reserve` tokens (a step already launched writes there: runtime/lookahead.py)."""
        keep = self.blocks_for(req.num_computed + reserve)
        while len(req.blocks) > keep:
            self.pool.release(req.blocks.pop())
        if not self.prefix_caching:
            return
        full = req.num_computed // self.block_size
        self._hash_upto(req, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.blocks[i], req.block_hashes[i])
        req.num_registered = full
        if self.hybrid and full and req.num_computed % self.block_size == 0:
            slot = self.slots.reserve(req.block_hashes[full - 1])
            if slot is not None:
                self.copies.append((req.kda_slot, slot))

    def free(self, req) -> None:
        """Release everything the request holds in the cache (finish, abort, error, preemption)."""
        for b in reversed(req.blocks):      # the tail is the least likely to be shared: evict it first
            self.pool.release(b)
        req.blocks = []
        if req.kda_slot is not None:
            self.slots.give(req.kda_slot)
            req.kda_slot = None
        req.num_computed = req.num_registered = 0

    def usage(self) -> dict[str, int]:
        return {"blocks_in_use": sum(r > 0 for r in self.pool.ref), "blocks_free": self.pool.num_free,
                "slots_in_use": self.slots.max_live - self.free_slots,
                "checkpoints": len(self.slots.ckpt)}

    def _hash_upto(self, req, n: int) -> None:
        bs, hashes = self.block_size, req.block_hashes
        while len(hashes) < n:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, req.token_ids[i * bs:(i + 1) * bs],
                                     media_key(req, i * bs, (i + 1) * bs)))
