"""Kimi's `tiktoken.model`: its byte-pair ranks and added tokens, served through the `tiktoken`
library when it is installed (ties break as Kimi's own tokenizer breaks them), else converted to an
equivalent `tokenizers` BPE; plus the byte-level tables both share with tokenizer.py."""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

log = logging.getLogger(__name__)

KIMI_RESERVED_SPECIAL_TOKENS = 256     # tokenization_kimi.py reserves this many ids after the ranks
# Kimi's pre-tokenizer pattern (tokenization_kimi.py `pat_str`); Oniguruma understands the `&&`
# class intersections, so `tokenizers` can split with it unchanged.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used; the message names the file and field."""


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte → printable character table, which byte-level BPE vocabularies are written in."""
    table = {b: chr(b) for r in ((0x21, 0x7E), (0xA1, 0xAC), (0xAE, 0xFF)) for b in range(r[0], r[1] + 1)}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return dict(sorted(table.items()))


BYTE_TO_CHAR = _byte_chars()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def added_token(token_id: int, content: str) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def _read_tiktoken(model_path: Path, config: dict, config_path: Path) -> tuple[dict[bytes, int], dict[int, str]]:
    """Kimi's tiktoken.model ranks and the added (special) tokens from tokenizer_config.json: every
    id from the end of the ranks up to KIMI_RESERVED_SPECIAL_TOKENS (or the largest named id), named
    or `<|reserved_token_{id}|>`."""
    ranks: dict[bytes, int] = {}
    try:
        lines = model_path.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{model_path}: cannot read ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise TokenizerError(f"{model_path}:{n}: expected 'base64 rank', got {line[:60]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{model_path}: ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    names = config.get("added_tokens_decoder") or {}
    if not isinstance(names, dict):
        raise TokenizerError(f"{config_path}: field 'added_tokens_decoder' must be an object")
    try:
        named = {int(k): v["content"] for k, v in names.items()}
    except (ValueError, TypeError, KeyError) as e:
        raise TokenizerError(f"{config_path}: field 'added_tokens_decoder' needs integer keys and "
                             f"entries with 'content' ({e})") from e
    end = max([len(ranks) + KIMI_RESERVED_SPECIAL_TOKENS, *(i + 1 for i in named)])
    return ranks, {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(len(ranks), end)}


def _to_str(b: bytes) -> str:
    return "".join(BYTE_TO_CHAR[x] for x in b)


def load_tiktoken(model_path: Path, config: dict, config_path: Path):
    """Kimi's format through the `tiktoken` library itself when it is installed (its byte-pair
    ranks are used directly, so every tie breaks as Kimi's own tokenizer breaks it); else as an
    equivalent `tokenizers` BPE (_tiktoken_as_bpe)."""
    ranks, added = _read_tiktoken(model_path, config, config_path)
    if importlib.util.find_spec("tiktoken") is not None:
        return _TiktokenBackend(model_path.parent.name, ranks, added)
    log.warning("%s: the tiktoken package is not installed; using a converted BPE whose tie-breaks "
                "may resolve differently (pip install tiktoken)", model_path)
    return _tiktoken_as_bpe(ranks, added)


def _tiktoken_as_bpe(ranks: dict[bytes, int], added_tokens: dict[int, str]) -> _Backend:
    """Kimi's ranks as an equivalent `tokenizers` BPE: vocab = the ranks, and for every token
    every split into two vocabulary tokens as a merge with the token's rank as priority, so BPE
    merges what tiktoken merges; `ignore_merges` looks a whole piece up first, as tiktoken does.
    (Ties between two splits of one token in one piece may resolve differently; rare.)"""
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None:
                merges.append((rank, left, right, _to_str(token[:i]), _to_str(token[i:])))
    merges.sort()
    added = [added_token(i, c) for i, c in added_tokens.items()]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": KIMI_PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True,
                  "vocab": {_to_str(t): r for t, r in ranks.items()},
                  "merges": [[m[3], m[4]] for m in merges]},
    }
    return _Backend.from_str(json.dumps(data))


@dataclass(frozen=True)
class _AddedToken:
    content: str
    special: bool = True


@dataclass(frozen=True)
class _Encoding:
    ids: list[int]


class _TiktokenBackend:
    """tiktoken's Encoding over Kimi's ranks, behind the part of the `tokenizers` API that
    Tokenizer uses (tokens as byte-level strings, added tokens all special)."""

    def __init__(self, name: str, ranks: dict[bytes, int], added: dict[int, str]) -> None:
        import tiktoken  # noqa: PLC0415 (optional: tiktoken)

        self._enc = tiktoken.Encoding(f"kimi-{name}", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={c: i for i, c in added.items()})
        self._ranks, self._bytes = ranks, {r: b for b, r in ranks.items()}
        self._added, self._added_ids = added, {c: i for i, c in added.items()}
        self.encode_special_tokens = True       # as tokenizers: True = special strings are text

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        if self.encode_special_tokens:
            return _Encoding(self._enc.encode_ordinary(text))
        return _Encoding(self._enc.encode(text, allowed_special="all"))

    def get_added_tokens_decoder(self) -> dict[int, _AddedToken]:
        return {i: _AddedToken(c) for i, c in self._added.items()}

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        vocab = {_to_str(b): r for b, r in self._ranks.items()}
        return {**vocab, **self._added_ids} if with_added_tokens else vocab

    def token_to_id(self, token: str) -> int | None:
        if token in self._added_ids:
            return self._added_ids[token]
        try:
            return self._ranks.get(bytes(CHAR_TO_BYTE[c] for c in token))
        except KeyError:
            return None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id]
        b = self._bytes.get(token_id)
        return None if b is None else _to_str(b)
