"""A reduced draft vocabulary (FR-Spec / EAGLE-3): the drafter's lm_head scores only the N most
frequent token ids, so a draft step reads N rows of the head instead of V. Drafts map back to
full ids; the target's verify step stays full-vocabulary, so acceptance (and therefore the output)
is exactly what it is with any other drafter, only drafts outside the N ids are never proposed.

    ids = make_draft_vocab(counts, n)          # int64 [n]: the n ids with the highest counts
    ids = draft_vocab_ids(n, counts_file, V)   # the same from a file, or merge order without one
    head = DraftHead(model.lm_head, ids)       # ids None: the full head
    logits = head(x)                           # fp32 [R, n]: columns are ids
    token = head.full_id(col)

Where the counts come from (``draft_vocab_ids``):
  a file           JSON: a list of counts indexed by token id, or an object {"id": count};
                   any other file: one count per line, line i for token i. Make one from
                   representative text: save_token_counts(path, count_tokens(map(tok.encode,
                   texts), V)).
  none (fallback)  the tokenizer's ids in merge order: a byte-level BPE's id is its merge rank, and
                   earlier merges are the more frequent pairs, so ids 0..n-1 approximate the top n.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def make_draft_vocab(counts: torch.Tensor | Sequence[int], n: int, *, vocab_size: int | None = None,
                     corpus: bool = False) -> torch.Tensor:
    """The n most frequent ids, most frequent first (int64 [n]; ties: lower id first).
    `counts`: per-id counts [V] or, with corpus=True, a sequence of token ids to count."""
    c = torch.as_tensor(counts, dtype=torch.int64).flatten()
    if corpus:
        if vocab_size is None:
            raise ValueError("make_draft_vocab(corpus=True) needs vocab_size")
        if len(c) and (int(c.min()) < 0 or int(c.max()) >= vocab_size):
            raise ValueError(f"corpus ids must lie in 0..{vocab_size - 1}")
        c = torch.bincount(c, minlength=vocab_size)
    elif vocab_size is not None and len(c) != vocab_size:
        raise ValueError(f"{len(c)} token counts for a vocabulary of {vocab_size}: one count per id is needed")
    if not 1 <= n <= len(c):
        raise ValueError(f"draft vocabulary size {n} must be in 1..{len(c)} (the vocabulary size)")
    # a stable sort of -counts: ties keep the lower id first (merge order)
    return torch.sort(-c, stable=True).indices[:n].clone()


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Per-id counts int64 [vocab_size] over tokenized text (e.g. ``tokenizer.encode`` of a corpus)."""
    out = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in sequences:
        if len(ids):
            out += torch.bincount(torch.as_tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return out


def save_token_counts(path: str | Path, counts: torch.Tensor) -> None:
    """Write per-id counts as a counts file (a JSON list indexed by id) ``load_token_counts`` reads."""
    Path(path).write_text(json.dumps(torch.as_tensor(counts).tolist()))


def load_token_counts(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Per-id counts int64 [vocab_size] from a counts file (module doc); ids the file does not name
    count 0. A malformed file is a ValueError naming it."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
            items = data.items() if isinstance(data, dict) else enumerate(data)
            pairs = [(int(i), int(c)) for i, c in items]
        else:
            pairs = [(i, int(line)) for i, line in enumerate(x for x in text.splitlines() if x.strip())]
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"token counts file {path}: {e}; expected JSON (a list of counts by id, or "
                         "{\"id\": count}) or one count per line") from e
    out = torch.zeros(vocab_size, dtype=torch.int64)
    for i, c in pairs:
        if not 0 <= i < vocab_size or c < 0:
            raise ValueError(f"token counts file {path}: id {i} / count {c} outside 0..{vocab_size - 1} / >= 0")
        out[i] = c
    return out


def draft_vocab_ids(n: int, counts_file: str | Path | None, vocab_size: int) -> torch.Tensor:
    """The reduced draft vocabulary of size n: top n of the counts file, else merge order (module doc)."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size {n} must be in 1..{vocab_size} (the model's vocabulary)")
    if counts_file is None:
        log.info("draft vocabulary: the first %d ids in merge order (no token counts file given)", n)
        return torch.arange(n, dtype=torch.int64)
    ids = make_draft_vocab(load_token_counts(counts_file, vocab_size), n)
    log.info("draft vocabulary: the %d most frequent ids of %s", n, counts_file)
    return ids


class DraftHead:
    """The lm_head columns a drafter scores: every id, or those of a reduced draft vocabulary (a
    gathered copy of their weight rows, made once)."""

    def __init__(self, lm_head: nn.Linear, ids: torch.Tensor | None = None,
                 full: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`full`: what computes every id's logit (default lm_head; a vocab-parallel model's gathers)."""
        self.lm_head, self.full = lm_head, full or lm_head
        w = lm_head.weight
        if ids is None:
            self.ids = self.weight = self.bias = None
            self.size = w.shape[0]
            return
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= w.shape[0] \
                or len(ids.unique()) != len(ids):
            raise ValueError(f"a draft vocabulary is distinct ids in 0..{w.shape[0] - 1} (the lm_head's rows); "
                             f"got {len(ids)} ids")
        self.ids = ids.to(w.device)
        self.id_list = ids.tolist()
        self.weight = w.detach()[self.ids].contiguous()
        self.bias = None if lm_head.bias is None else lm_head.bias.detach()[self.ids].contiguous()
        self.size = len(ids)

    @property
    def reduced(self) -> bool:
        return self.ids is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits fp32 [R, size] for hidden rows x [R, H] (after the final norm)."""
        y = self.full(x) if self.ids is None else F.linear(x, self.weight, self.bias)
        return y.float()

    def full_id(self, col: int) -> int:
        return col if self.ids is None else self.id_list[col]

    def full_ids(self, cols: torch.Tensor) -> torch.Tensor:
        """full_id on the device: the ids of columns int64 [...]."""
        return cols if self.ids is None else self.ids[cols]

    def columns(self, full: torch.Tensor) -> torch.Tensor:
        """Per-id values [..., V] -> the head's columns [..., size] (e.g. a grammar's allowed ids)."""
        return full if self.ids is None else full[..., self.ids]

    def to_full(self, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A distribution over the head's columns [..., size] -> over every id [..., V] (0 elsewhere)."""
        if self.ids is None:
            return q
        out = q.new_zeros(*q.shape[:-1], vocab_size)
        out[..., self.ids] = q
        return out
