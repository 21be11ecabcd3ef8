"""A strict comparator for tests and kernel checks (used by tests and benchmarks alike), and bitwise
equality for the checks that must hold bit for bit."""

from __future__ import annotations

import torch

# Relative-error budgets per dtype of the computation under test, against an fp32/fp64 oracle.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-9, rel_norm=1e-10),
    torch.float32: dict(atol=1e-5, rtol=1e-4, rel_norm=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2, rel_norm=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3, rel_norm=2e-3),
    torch.float8_e4m3fn: dict(atol=6e-2, rtol=6e-2, rel_norm=1e-2),
}


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits as integers of its element size (NaN payloads and -0.0 compare as they are)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and the same bits in every element."""
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rel_norm_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 (0 when both are zero)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = r.norm().item()
    num = (o - r).norm().item()
    return num if denom == 0 else num / denom


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, dtype: torch.dtype | None = None,
                 atol: float | None = None, rtol: float | None = None,
                 rel_norm: float | None = None, name: str = "output") -> None:
    """Fail unless `out` matches `ref`: same shape, same NaN/inf mask, every element within
    atol + rtol·|ref|, and the relative norm error under `rel_norm`. The message names the
    worst element, so a failure says where to look."""
    tol = dict(TOLERANCES[dtype or out.dtype])
    tol.update({k: v for k, v in dict(atol=atol, rtol=rtol, rel_norm=rel_norm).items() if v is not None})
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.equal(torch.isnan(o), torch.isnan(r)):
        idx = (torch.isnan(o) != torch.isnan(r)).nonzero()[0].tolist()
        raise AssertionError(f"{name}: NaN mask differs first at {idx}: out={o[tuple(idx)].item()} "
                             f"ref={r[tuple(idx)].item()}")
    if not torch.equal(torch.isinf(o), torch.isinf(r)):
        idx = (torch.isinf(o) != torch.isinf(r)).nonzero()[0].tolist()
        raise AssertionError(f"{name}: inf mask differs first at {idx}")
    finite = torch.isfinite(r)
    o, r = torch.where(finite, o, 0.0), torch.where(finite, r, 0.0)
    err = (o - r).abs()
    excess = err - (tol["atol"] + tol["rtol"] * r.abs())
    rn = rel_norm_error(o, r)
    if excess.numel() and excess.max().item() > 0 or rn > tol["rel_norm"]:
        flat = int(excess.argmax()) if excess.numel() else 0
        idx = list(torch.unravel_index(torch.tensor(flat), excess.shape)) if excess.dim() else []
        idx = [int(i) for i in idx]
        worst = f"out={o.flatten()[flat].item():.6g} ref={r.flatten()[flat].item():.6g}" if excess.numel() else ""
        raise AssertionError(
            f"{name}: max abs err {err.max().item() if err.numel() else 0:.3g} at {idx} ({worst}); "
            f"rel-norm err {rn:.3g} (budget {tol['rel_norm']:.1g}); atol {tol['atol']:.1g} rtol {tol['rtol']:.1g}")
