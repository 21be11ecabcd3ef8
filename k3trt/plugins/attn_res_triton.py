"""Triton kernel behind ``k3trt::attn_res`` on CUDA (imported on the op's first CUDA call by the
kernel that attn_res.py registers, so importing k3trt never needs triton).

    attn_res_fwd(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
        -> (out, new_prefix)                       (mutates blocks[:, write_idx] when write_idx >= 0)

Layouts and rounding are the op's (attn_res.py module doc). No host synchronisation, and only the
two outputs are allocated: capturable in a CUDA graph (compile it with one eager call first).

Design: one program per token row, looping over H in chunks of BH columns with every source of
the row in one [SP, BH] tile (SP = the source count rounded up to a power of two, rows past it
masked, so masked rows cost no memory traffic). Four passes over the row:
  1. new_prefix = dtype(prefix + delta), stored (and into blocks[t, write_idx]); Σv² per source;
  2. logits (the RMSNorm-ed, dtype-rounded sources dotted with w_q); softmax over sources in fp32;
  3. mixed = dtype(Σ α_s v_s), stored into out; Σ mixed² when out_norm is given;
  4. (out_norm only) out = rms_norm(mixed) read back from out.
Passes 2-4 read back what this program stored (new_prefix, out) after a CTA barrier, so the
write slot is never read from blocks: before the write it holds stale data the reference never
sees. A row's sources are ~70 KB (S = 5, H = 7168, bf16), so passes 2-4 mostly hit L1/L2.

Why not split a row over several programs at T = 1: every pass needs whole-row reductions (Σv²
per source, then the logits, then Σ mixed²), so a split needs a cross-CTA reduction: a second
launch (the ~2 µs this op exists to save) or a grid-wide spin barrier (unsafe unless all CTAs are
co-resident, and hard to keep capturable). One CTA of 8 warps re-reads a ~70 KB row (S = 5) three
or four times, from L1/L2 after the first pass: an estimate of a few µs, not timed here.

Why SP is a constexpr but num_blocks is not: num_blocks changes every B layers (up to ~30 values
in the full model), and a constexpr per value would mean one JIT compile and one graph-warmup
variant each; power-of-two buckets (SP = 2 .. 64) give at most 6. For the same reason num_blocks
and write_idx are kept out of Triton's value-1 / divisibility-by-16 specialisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp32 elements per [SP, BH] tile: 32 per thread at 8 warps, so the tile and its temporaries stay in
# registers. BH never drops below MIN_BH columns (SP = 64 -> 128-wide chunks, 56 of them at K3's H).
TILE_ELEMS = 8192
MAX_BH = 2048
MIN_BH = 64
NUM_WARPS = 8


@triton.jit(do_not_specialize=["num_blocks", "write_idx"])
def _attn_res_kernel(PREFIX, DELTA, BLOCKS, W_NORM, W_Q, OUT_NORM, OUT, NEW_PREFIX,
                     H, num_blocks, write_idx, eps,
                     sp_t, sp_h, sd_t, sd_h, sb_t, sb_s, sb_h, s_wn, s_wq, s_on,
                     HAS_DELTA: tl.constexpr, HAS_OUT_NORM: tl.constexpr, SP: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)           # int64: t * sb_t passes 2^31 at T·NB·H > 2G
    dt = NEW_PREFIX.dtype.element_ty
    src = tl.arange(0, SP)
    # the write slot, when it is also a source, is the new prefix (the reference writes, then reads)
    from_mem = (src < num_blocks) & (src != write_idx)
    is_p = (src == num_blocks) | ((src < num_blocks) & (src == write_idx))
    row_b = t * sb_t
    src_rows = BLOCKS + row_b + src[:, None] * sb_s                          # [SP, 1]
    # all-or-nothing store mask written as a bound on the columns (Triton's interpreter rejects a
    # scalar bool broadcast into a block mask); the address uses slot 0 when there is no write
    write_cols = (write_idx >= 0).to(tl.int32) * H
    write_row = BLOCKS + row_b + tl.maximum(write_idx, 0).to(tl.int64) * sb_s

    ss = tl.zeros([SP], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        in_h = cols < H
        p = tl.load(PREFIX + t * sp_t + cols * sp_h, mask=in_h, other=0.0)
        if HAS_DELTA:
            d = tl.load(DELTA + t * sd_t + cols * sd_h, mask=in_h, other=0.0)
            p = p.to(tl.float32) + d.to(tl.float32)
        p = p.to(dt)
        tl.store(NEW_PREFIX + t * H + cols, p, mask=in_h)
        tl.store(write_row + cols * sb_h, p, mask=cols < write_cols)
        # [SP, BH] fp32: blocks rows where from_mem, the new prefix where is_p, else 0 (written
        # out in each pass: a nested jit call costs the interpreter ~10x this kernel's own ops)
        x = tl.load(src_rows + cols[None, :] * sb_h, mask=from_mem[:, None] & in_h[None, :], other=0.0)
        x = tl.where(is_p[:, None], p.to(tl.float32)[None, :], x.to(tl.float32))
        ss += tl.sum(x * x, axis=1)
    r = tl.math.rsqrt(ss / H + eps)
    tl.debug_barrier()                          # new_prefix, stored above by other threads

    logit = tl.zeros([SP], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        in_h = cols < H
        p = tl.load(NEW_PREFIX + t * H + cols, mask=in_h, other=0.0)
        x = tl.load(src_rows + cols[None, :] * sb_h, mask=from_mem[:, None] & in_h[None, :], other=0.0)
        x = tl.where(is_p[:, None], p.to(tl.float32)[None, :], x.to(tl.float32))
        wn = tl.load(W_NORM + cols * s_wn, mask=in_h, other=0.0).to(tl.float32)
        wq = tl.load(W_Q + cols * s_wq, mask=in_h, other=0.0).to(tl.float32)
        y = ((x * r[:, None]) * wn[None, :]).to(dt).to(tl.float32)
        logit += tl.sum(y * wq[None, :], axis=1)
    logit = tl.where(src <= num_blocks, logit, float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=0))
    alpha = e / tl.sum(e, axis=0)

    ss_out = tl.zeros([BH], dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        in_h = cols < H
        p = tl.load(NEW_PREFIX + t * H + cols, mask=in_h, other=0.0)
        x = tl.load(src_rows + cols[None, :] * sb_h, mask=from_mem[:, None] & in_h[None, :], other=0.0)
        x = tl.where(is_p[:, None], p.to(tl.float32)[None, :], x.to(tl.float32))
        mixed = tl.sum(alpha[:, None] * x, axis=0).to(dt)
        tl.store(OUT + t * H + cols, mixed, mask=in_h)
        if HAS_OUT_NORM:
            mf = mixed.to(tl.float32)
            ss_out += mf * mf

    if HAS_OUT_NORM:
        r_out = tl.math.rsqrt(tl.sum(ss_out, axis=0) / H + eps)
        tl.debug_barrier()                      # mixed, stored above by other threads
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            in_h = cols < H
            m = tl.load(OUT + t * H + cols, mask=in_h, other=0.0).to(tl.float32)
            w = tl.load(OUT_NORM + cols * s_on, mask=in_h, other=0.0).to(tl.float32)
            tl.store(OUT + t * H + cols, ((m * r_out) * w).to(dt), mask=in_h)


def block_sizes(num_sources: int, H: int) -> tuple[int, int]:
    """(SP, BH): the tile's source rows (a power of two >= 2) and its columns per chunk."""
    # two rows at least: a one-source read (layer 0 only) then never needs a size-1 tile axis
    sp = max(2, triton.next_power_of_2(num_sources))
    bh = max(MIN_BH, min(MAX_BH, TILE_ELEMS // sp))
    return sp, min(bh, max(16, triton.next_power_of_2(H)))


def attn_res_fwd(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, w_norm: torch.Tensor,
                 w_q: torch.Tensor, out_norm: torch.Tensor | None, num_blocks: int, write_idx: int,
                 eps: float, block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel, one program per token row. Arguments are the op's, already checked;
    block_h (a power of two) overrides the columns per chunk (tests use it to loop over small H)."""
    T, H = prefix.shape
    out = torch.empty((T, H), dtype=prefix.dtype, device=prefix.device)
    new_prefix = torch.empty((T, H), dtype=prefix.dtype, device=prefix.device)
    if T == 0:
        return out, new_prefix
    sp, bh = block_sizes(num_blocks + 1, H)
    if block_h is not None:
        if block_h < 16 or block_h & (block_h - 1):
            raise ValueError(f"attn_res: block_h must be a power of two >= 16, got {block_h}")
        bh = block_h
    # absent tensors: a stand-in pointer the constexpr flags keep unread
    d = delta if delta is not None else prefix
    on = out_norm if out_norm is not None else w_norm
    _attn_res_kernel[(T,)](
        prefix, d, blocks, w_norm, w_q, on, out, new_prefix,
        H, num_blocks, write_idx, float(eps),
        prefix.stride(0), prefix.stride(1), d.stride(0), d.stride(1),
        blocks.stride(0), blocks.stride(1), blocks.stride(2), w_norm.stride(0), w_q.stride(1), on.stride(0),
        HAS_DELTA=delta is not None, HAS_OUT_NORM=out_norm is not None, SP=sp, BH=bh, num_warps=NUM_WARPS,
    )
    return out, new_prefix
