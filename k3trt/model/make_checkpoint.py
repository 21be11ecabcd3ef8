"""Random-weight Kimi K3 checkpoints in the real Hugging Face layout.

``make_checkpoint("tiny", out)`` writes config.json, generation_config.json, sharded safetensors with
model.safetensors.index.json (tensor names and shapes as published, k3trt/model/layout.py, the
vision tower and projector included), and a real tokenizer (DeepSeek's, extended with the K3 special
tokens) with tokenizer_config.json and a chat template. Same preset and seed, same bytes.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from k3trt.config import ModelConfig
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.loader import build_model
from k3trt.model.presets import PRESETS, preset_config
from k3trt.model.quant import fp8_quantization_config, mxfp4_quantization_config
from k3trt.model.weights import checkpoint_tensors, init_random_
from k3trt.runtime.chat import MEDIA_PAD
from k3trt.runtime.tokenizer import Tokenizer, write_k3_tokenizer

log = logging.getLogger(__name__)

# Shard size per preset: small enough that even tiny has several shards (exercises the index).
SHARD_BYTES = {"tiny": 8 << 20, "small": 128 << 20, "medium": 4 << 30, "spec": 4 << 30}
VOCAB_MULTIPLE = 128


def make_checkpoint(preset: str, out_dir: str | Path, *, seed: int = 0, quant: str = "none",
                    device: str = "cpu") -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new --output directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_k3_tokenizer(tmp)
        tok = Tokenizer.from_dir(tmp)
        vocab = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        raw = preset_config(preset, vocab, pad_token_id=tok.pad_token_id)
        raw["media_placeholder_token_id"] = tok.special_ids[MEDIA_PAD]     # this tokenizer's, not K3's
        cfg = ModelConfig.from_dict(raw)
        log.info("making %s checkpoint: %d layers, vocab %d, seed %d", preset, cfg.num_hidden_layers, vocab, seed)
        model = build_model(cfg, dtype=torch.float32, device=device)
        init_random_(model, seed)
        # weights ship in bf16 (quantized formats keep their own dtypes, e.g. fp32 block scales)
        tensors = checkpoint_tensors(model.to(torch.bfloat16), cfg, quant)
        del model
        if quant != "none":
            raw["text_config"]["quantization_config"] = quant_config(quant)
        write_checkpoint(tmp, {k: v.cpu() for k, v in tensors.items()}, max_shard_bytes=SHARD_BYTES[preset])
        (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
               "pad_token_id": tok.pad_token_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out_dir)
    return out_dir


def quant_config(quant: str) -> dict:
    return {"fp8": fp8_quantization_config, "mxfp4": mxfp4_quantization_config}[quant]()
