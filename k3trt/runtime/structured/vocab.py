"""One tokenizer as xgrammar sees it, and the token bitmasks: layout, allocation, application.

Bitmask layout (xgrammar's): int32 [rows, ceil(V / 32)] on the CPU; token t is allowed in row r iff
bit (t % 32) of word (t // 32) is set. V is the *model's* vocabulary size
(`GrammarVocab.vocab_size`), which may exceed the tokenizer's: ids past the tokenizer's are never
allowed.

How the K3 tokenizer is described to xgrammar (`GrammarVocab`):
- ordinary tokens: their exact bytes (VocabType.RAW), so grammars match what the detokenizer prints;
- the XTML markers `<|open|>`, `<|close|>`, `<|sep|>`: a two-byte string starting with 0xFF. No
  UTF-8 text contains 0xFF, so no text grammar (JSON string, regex, `.*`, EBNF class) can ever emit
  a marker, yet a structural tag can still ask for one by id (a token with empty bytes could not be
  asked for at all: xgrammar treats those as special and masks them everywhere);
- every other special token (reserved fillers, DeepSeek's placeholders, bos, pad): empty bytes, so
  xgrammar treats it as special and never allows it;
- `<|end_of_msg|>` (eos) is the grammar's only stop token: allowed exactly when the grammar is done.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import torch

from k3trt.runtime.xtml import CLOSE, OPEN, SEP

log = logging.getLogger(__name__)

_XGR_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)    # xgrammar's CPU kernel takes these
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def xgr() -> Any:
    """xgrammar, imported on first use: it is slow to import (it pulls in transformers) and only
    requests with a grammar need it."""
    try:
        import xgrammar  # noqa: PLC0415 (optional: xgrammar)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("structured output needs the xgrammar package "
                          "(pip install xgrammar)") from e
    return xgrammar


def _has_xgrammar() -> bool:
    try:
        xgr()
        return True
    except ImportError:  # pragma: no cover - depends on the environment
        return False


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [..., N] -> int32 bitmask [..., ceil(N / 32)] (missing tail bits are 0)."""
    n = allowed.shape[-1]
    pad = num_words(n) * 32 - n
    a = torch.nn.functional.pad(allowed.to(torch.int32), (0, pad)).view(*allowed.shape[:-1], -1, 32)
    # disjoint bits: the sum is an OR, and the one negative bit (31) cannot overflow it
    return (a * _BITS).sum(-1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """int32 bitmask [..., W] -> bool [..., width] (default W * 32); ids past W * 32 are False."""
    bits = (bitmask.unsqueeze(-1) & _BITS.to(bitmask.device)).ne(0).flatten(-2)
    width = bits.shape[-1] if width is None else width
    if width <= bits.shape[-1]:
        return bits[..., :width]
    return torch.nn.functional.pad(bits, (0, width - bits.shape[-1]))


def is_allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return (int(bitmask[row, token >> 5]) >> (token & 31)) & 1 == 1


class GrammarVocab:
    """xgrammar's TokenizerInfo for one tokenizer and model vocabulary size, plus the fixed mask
    rows the runtime needs besides grammar masks. Immutable once built; safe to share."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        x = xgr()
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{tokenizer.source}: the tokenizer has no eos token; a grammar "
                             f"needs one to end on")
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        self.eos_id = int(tokenizer.eos_token_id)
        special = tokenizer.special_ids
        self.open_id, self.close_id, self.sep_id = (special.get(m) for m in (OPEN, CLOSE, SEP))
        self.has_markers = None not in (self.open_id, self.close_id, self.sep_id)
        n = min(tokenizer.vocab_size, self.vocab_size)
        if self.eos_id >= self.vocab_size:
            raise ValueError(f"eos id {self.eos_id} is outside the model's vocabulary "
                             f"({self.vocab_size})")
        self.has_markers = self.has_markers and max(self.open_id, self.close_id, self.sep_id) < n
        encoded = [tokenizer.id_to_bytes(i) for i in range(n)]
        self.special_ids = frozenset(i for i in special.values() if i < n)
        for i in self.special_ids:
            encoded[i] = b""
        # 0xFF + a distinct byte: reachable by id only (see the module doc)
        for k, i in enumerate((self.open_id, self.close_id, self.sep_id)):
            if i is not None and i < n:
                encoded[i] = bytes((0xFF, k + 1))
        self._bytes = encoded
        self._encode = tokenizer.encode
        self.info = x.TokenizerInfo(encoded, x.VocabType.RAW, vocab_size=self.vocab_size,
                                    stop_token_ids=[self.eos_id])
        h = hashlib.sha256(f"{self.vocab_size}:{self.eos_id}:".encode())
        for b in encoded:
            h.update(len(b).to_bytes(2, "little") + b)
        self.fingerprint = h.hexdigest()  # the tokenizer's identity in compile-cache keys
        self.num_words = num_words(self.vocab_size)
        free = torch.zeros(self.vocab_size, dtype=torch.bool)
        free[:n] = True
        free[self.eos_id] = False
        # Before the grammar starts (reasoning) anything the tokenizer has may follow, but not eos:
        # the output must still reach its grammar. Padded ids stay masked.
        self.free_row = pack(free)
        eos = torch.zeros(self.vocab_size, dtype=torch.bool)
        eos[self.eos_id] = True
        self.eos_row = pack(eos)  # after the grammar ended: only eos
        log.debug("grammar vocab: %d ids (%d from the tokenizer), %d special, markers %s",
                  self.vocab_size, n, len(self.special_ids), self.has_markers)

    def canonical_ids(self, text: str) -> tuple[int, ...] | None:
        """The tokenizer's own encoding of `text` (ordinary tokens whose bytes spell it exactly), or
        None. Fixed XTML text is asked for as these ids: a grammar of bytes would also allow any
        other split into tokens, which costs a model off its training distribution more tokens."""
        ids = tuple(self._encode(text))
        ok = all(0 <= i < len(self._bytes) and i not in self.special_ids for i in ids)
        return ids if ok and b"".join(self._bytes[i] for i in ids) == text.encode() else None

    def token_bytes(self, token: int) -> bytes:
        """The token's text bytes as the grammar sees them (b"" for special tokens and padding)."""
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def allocate_bitmask(self, rows: int, *, pin: bool = False) -> torch.Tensor:
        """An all-allowed int32 bitmask [rows, num_words] on the CPU (pinned: fast H2D copies)."""
        bm = torch.full((rows, self.num_words), -1, dtype=torch.int32)
        return bm.pin_memory() if pin and torch.cuda.is_available() else bm


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor,
                indices: Sequence[int] | None = None) -> torch.Tensor:
    """Mask logits [R, V'] in place (and return them): -inf wherever row r of bitmask [R, W] has a
    0 bit, and at every id >= W * 32 (vocabulary padding the mask does not cover). `indices` picks
    the rows to mask (a batch mixing guided and unguided requests); other rows are untouched.
    CUDA logits: xgrammar's kernel (the bitmask is copied over if it is on the CPU); CPU: xgrammar's
    CPU kernel (fp32 / bf16 / fp16), else torch. The row indices become a device tensor only where
    the torch path or vocabulary padding needs them (no host-to-device copy on the CUDA path)."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"apply_masks: logits [R, V] and bitmask [R, W], got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if indices is not None and len(indices) == 0:
        return logits
    covered = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.device.type == "cuda":
        bm = bitmask.to(logits.device, non_blocking=True)
        xgr().apply_token_bitmask_inplace(logits, bm, vocab_size=covered,
                                          indices=None if indices is None else list(indices))
    elif (logits.device.type == "cpu" and logits.dtype in _XGR_CPU_DTYPES and bitmask.device.type == "cpu"
          and bitmask.dtype == torch.int32 and _has_xgrammar()):
        # xgrammar's C++ kernel: many times faster than unpacking the bitmask with torch
        xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered,
                                          indices=None if indices is None else list(indices))
    else:
        rows = None if indices is None else torch.as_tensor(list(indices), dtype=torch.long,
                                                            device=logits.device)
        bm = bitmask if rows is None else bitmask[rows.cpu()]
        banned = ~unpack(bm.to(logits.device), covered)
        if rows is None:
            logits[:, :covered].masked_fill_(banned, float("-inf"))
        else:
            logits[rows, :covered] = logits[rows, :covered].masked_fill(banned, float("-inf"))
    if logits.shape[-1] > covered:
        if indices is None:
            logits[:, covered:] = float("-inf")
        else:
            logits[torch.as_tensor(list(indices), dtype=torch.long, device=logits.device), covered:] = float("-inf")
    return logits
