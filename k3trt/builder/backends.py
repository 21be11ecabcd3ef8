"""Every check a TensorRT build can fail before its long work, in the order preflight runs them:
the checkpoint (check_checkpoint), the backend installed, the target it can build for
(check_target), the prefill capacities a native-lowered graph can hold (NATIVE_MAX_PREFILL), the disk
(estimate_build_bytes, check_disk). The backend registry itself (names, installed modules, lazy
loading, runnable_here) is part of the engine format: k3trt/engine/backends.py;
builder/tensorrt.py describes both backends, the plugin graphs and the native fallback.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from k3trt.config import ConfigError, ModelConfig
from k3trt.engine import backends as registry
from k3trt.engine.backends import INSTALL, RTX_TARGETS
from k3trt.engine.capacities import Capacities

NATIVE_MAX_PREFILL = 64      # the native fallback unrolls KDA's recurrence: graph size grows with T


class BuildError(RuntimeError):
    """A build that cannot proceed; the message says why and what to do."""


# ------------------------------------------------------------------------------ checks before work
def normalize_target(target: str | None) -> str | None:
    if target is None:
        return None
    t = target.strip().lower().replace("_", "")
    if not t.startswith("sm") or not t[2:].isdigit():
        raise BuildError(f"target {target!r}: expected a GPU architecture like sm90 or sm120")
    return t


def check_target(backend: str, target: str | None) -> str | None:
    """The target the backend will build for, or a BuildError before any work starts."""
    t = normalize_target(target)
    if backend == "tensorrt-rtx":
        if t is None:
            raise BuildError(f"TensorRT-RTX builds ahead of time for a named GPU: pass --target, one of {RTX_TARGETS}")
        if t not in RTX_TARGETS:
            raise BuildError(f"TensorRT-RTX 1.7 cannot build for {t}; it builds for {', '.join(RTX_TARGETS)} "
                             "(datacenter GPUs such as sm90 need --backend tensorrt or torch)")
        return t
    if backend == "tensorrt":
        local = registry.local_gpu_target()
        if local is None:
            raise BuildError("full TensorRT builds on the GPU it targets and this machine has none; "
                             "build there, or use --backend tensorrt-rtx --target sm120 for an RTX GPU")
        if t is not None and t != local:
            raise BuildError(f"full TensorRT builds for the GPU present ({local}), not {t}; build on a {t} machine")
        return local
    raise BuildError(f"check_target: {backend!r} is not a TensorRT backend")


def check_checkpoint(path: str | Path) -> ModelConfig:
    """The checkpoint's ModelConfig, or a BuildError saying why it is not a usable K3 checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise BuildError(f"checkpoint {path} is not a directory (expected a Hugging Face checkpoint)")
    try:
        cfg = ModelConfig.from_json(path)
    except ConfigError as e:
        raise BuildError(f"checkpoint {path} is not a Kimi K3 checkpoint: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise BuildError(f"checkpoint {path} has a K3 config.json but no *.safetensors weights")
    return cfg


def estimate_build_bytes(weight_bytes: int, num_engines: int, *, weights_as_inputs: bool = True) -> int:
    """Peak disk a build needs: weights.bin, one graph's transient data file before it is
    shared, and the engines (about 1/5 of the weights each with weights as inputs on tiny:
    activations and folded constants; a full copy each otherwise), plus 10%."""
    per_engine = weight_bytes // 5 if weights_as_inputs else weight_bytes * 11 // 10
    return int((2 * weight_bytes + num_engines * per_engine) * 1.1)


def check_disk(directory: str | Path, need_bytes: int) -> None:
    directory = Path(directory)
    probe = next((p for p in [directory, *directory.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise BuildError(f"not enough disk under {probe}: the build needs about {need_bytes / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB are free; free space or choose another --output")


def preflight(checkpoint: str | Path, output: str | Path, *, backend: str, target: str | None,
              capacities: Capacities, dtype: str = "bf16", lowering: str = "plugin") -> ModelConfig:
    """Every check a TensorRT build can fail before its long work, in order; returns the ModelConfig."""
    cfg = check_checkpoint(checkpoint)
    if backend not in registry.installed_backends():
        raise BuildError(f"backend {backend!r} is not installed; install it with: {INSTALL[backend]}")
    target = check_target(backend, target)
    if backend == "tensorrt-rtx" and dtype == "bf16" and target == "sm75":
        raise BuildError("sm75 has no bf16: build with --dtype fp16 or fp32, or another --target")
    if lowering == "native":
        if backend != "tensorrt-rtx":
            raise BuildError("--rtx-lowering native is TensorRT-RTX's fallback; full TensorRT builds plugin graphs")
        big = [t for t in capacities.prefill if t > NATIVE_MAX_PREFILL]
        if big:
            raise BuildError(f"the native lowering unrolls the KDA recurrence: prefill capacities {big} exceed "
                             f"{NATIVE_MAX_PREFILL}; lower --max-num-tokens, or build the plugin graphs "
                             "(--rtx-lowering plugin, the default)")
    weight_bytes = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    scale = 2 if dtype == "fp32" else 1               # checkpoints ship 16-bit weights
    check_disk(output, estimate_build_bytes(weight_bytes * scale, len(capacities.verify) + len(capacities.prefill)))
    return cfg
