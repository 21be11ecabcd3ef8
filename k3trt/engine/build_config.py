"""``BuildConfig``: the build options an engine directory records (``build`` in config.json) and
the runtime reads back: dtypes, the KV cache format, block size and the step and sequence bounds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPES = ("auto", "bf16", "fp8")


@dataclass(frozen=True)
class BuildConfig:
    dtype: str = "bf16"            # weights and activations: fp32 | bf16 | fp16
    kv_dtype: str = "auto"         # MLA cache: auto (= dtype) | bf16 | fp8 (e4m3, per-tensor kv_scale)
    kv_scale: float = 1.0
    block_size: int = 64
    max_num_tokens: int = 8192     # tokens per step: prefill chunk + verify rows
    max_seq_len: int = 8192        # prompt + output per request

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"build option {name}={getattr(self, name)!r}: {msg}")

        need(self.dtype in DTYPES, "dtype", f"choose one of {sorted(DTYPES)}")
        need(self.kv_dtype in KV_DTYPES, "kv_dtype", f"choose one of {KV_DTYPES}")
        # the fused MLA op reads an unquantised cache in the query's dtype
        need(self.kv_dtype != "bf16" or self.dtype == "bf16", "kv_dtype",
             f"a bf16 cache needs dtype bf16 (dtype is {self.dtype}); use kv_dtype auto or fp8")
        need(self.kv_scale > 0, "kv_scale", "must be > 0")
        need(self.block_size > 0 and self.block_size % 16 == 0, "block_size", "must be a positive multiple of 16")
        need(self.max_num_tokens > 0, "max_num_tokens", "must be > 0")
        need(self.max_seq_len > 1, "max_seq_len", "must be > 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_dtype == "fp8" else self.torch_dtype
