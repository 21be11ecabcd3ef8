"""Speculative decoding: drafters behind one interface (drafter.py) and acceptance as pure
functions (acceptance.py). ``make_drafter`` maps the CLI's ``--speculative`` value to a drafter;
the model-running drafters are imported lazily so that n-gram drafting needs nothing else.

    none          no drafts
    ngram         prompt lookup (ngram.py)
    draft:DIR     a smaller K3-format checkpoint with its own caches (draft_model.py)
    mtp           the target's MTP layer (mtp.py; the runtime hands over hidden states)
    layerskip:N   the target's first N layers as its own draft, no new weights (layer_skip.py)

The model drafters (draft, mtp, layerskip) draw guided requests' drafts under their grammar and
may score a reduced draft vocabulary (draw.py, draft_vocab.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3trt.runtime.speculative.acceptance import (
    AcceptanceStats,
    Accepted,
    accept_greedy,
    accept_stochastic,
    pad_drafts,
    pad_q,
)
from k3trt.runtime.speculative.draft_model import DraftModelDrafter
from k3trt.runtime.speculative.draft_vocab import draft_vocab_ids, make_draft_vocab
from k3trt.runtime.speculative.drafter import Drafter, DraftInput, NoDrafter, Proposal
from k3trt.runtime.speculative.layer_skip import LayerSkipDrafter
from k3trt.runtime.speculative.mtp import MTPDrafter
from k3trt.runtime.speculative.ngram import NgramConfig, NgramDrafter

MAX_SPEC_TOKENS = 7

__all__ = ["AcceptanceStats", "Accepted", "DraftInput", "Drafter", "NgramConfig", "NgramDrafter", "NoDrafter",
           "Proposal", "accept_greedy", "draft_vocab_ids", "make_draft_vocab", "accept_stochastic", "make_drafter", "pad_drafts", "pad_q",
           "spec_tokens_for"]


def spec_tokens_for(spec: str, requested: int | None, *, built: int) -> int:
    """K for a run: 0 without a drafter ("none"); else `requested`, or the engine's build value, or 3
    (a torch engine built with spec_tokens 0 verifies any K its token budget covers)."""
    if spec == "none":
        return 0
    k = requested if requested is not None else (built or 3)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
        raise ValueError(f"spec_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {k!r}")
    return k


def make_drafter(spec: str, *, k: int, max_live: int, max_model_len: int, target: torch.nn.Module | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", block_size: int = 16,
                 sample_drafts: bool = False, graphs: bool | None = None, draft_vocab_size: int | None = None,
                 draft_vocab_counts: str | Path | None = None) -> Drafter:
    """The drafter for `spec` (module doc). `target` (a K3ForCausalLM) is needed by mtp and
    layerskip and, for its vocabulary check, by draft:DIR; k is the most drafts per request (1..7).
    `graphs`: the model drafters' draft steps as CUDA graphs (None: on CUDA in bf16/fp16).
    `draft_vocab_size`: the model drafters score only that many ids, the most frequent by
    `draft_vocab_counts` (a counts file) or in merge order (draft_vocab.py)."""
    if not 1 <= k <= MAX_SPEC_TOKENS:
        raise ValueError(f"speculative tokens must be in 1..{MAX_SPEC_TOKENS}, got {k}")
    model_drafter = spec == "mtp" or spec.startswith(("draft:", "layerskip:"))
    if draft_vocab_size is not None and (not model_drafter or isinstance(draft_vocab_size, bool)
                                         or not isinstance(draft_vocab_size, int) or draft_vocab_size < 1):
        raise ValueError(f"draft_vocab_size {draft_vocab_size!r}: a positive number of ids for a model drafter "
                         f"(mtp, draft:DIR, layerskip:N), not --speculative {spec}")
    if draft_vocab_counts is not None and draft_vocab_size is None:
        raise ValueError("draft_vocab_counts needs draft_vocab_size (how many of the counted ids to keep)")

    def vocab(v: int) -> torch.Tensor | None:
        return None if draft_vocab_size is None else draft_vocab_ids(draft_vocab_size, draft_vocab_counts, v)

    kw = dict(k_max=k, max_live=max_live, max_model_len=max_model_len, block_size=block_size,
              sample_drafts=sample_drafts)
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    if spec.startswith("draft:"):
        path = Path(spec[len("draft:"):])
        if not (path / "config.json").is_file():
            raise ValueError(f"--speculative {spec}: {path} is not a checkpoint directory (no config.json); "
                             "`k3trt make-checkpoint` makes one")
        return DraftModelDrafter.from_checkpoint(path, target_cfg=getattr(target, "cfg", None), dtype=dtype,
                                                 device=device, draft_vocab=vocab, **kw)
    if spec == "mtp":
        if target is None:
            raise ValueError("--speculative mtp needs the target model (its MTP layers)")
        return MTPDrafter(target, target.cfg, graphs=graphs, draft_vocab=vocab(target.cfg.vocab_size), **kw)
    if spec.startswith("layerskip:"):
        n = spec[len("layerskip:"):]
        if target is None or not n.isdigit():
            raise ValueError(f"--speculative {spec}: needs the target model and a layer count (layerskip:N)")
        return LayerSkipDrafter(target, int(n), graphs=graphs, draft_vocab=vocab(target.cfg.vocab_size), **kw)
    raise ValueError(f"unknown --speculative {spec!r}; choose none, ngram, draft:DIR, mtp or layerskip:N")
