"""The backend registry: which backends an engine directory can name, which TensorRT-family
modules are installed, loading them lazily, and whether this machine could run their engines.

``torch`` engine dirs hold the checkpoint and run on the torch runtime. ``onnx`` dirs hold the
per-capacity ONNX graphs the TensorRT backends build from (k3trt ops as custom nodes) and run in
onnxruntime on the CPU (runtime/onnx_session.py: the engine contract executed anywhere). ``tensorrt`` (full
TensorRT >= 10.8, engines for the GPU they were built on) and ``tensorrt-rtx`` (TensorRT-RTX 1.7,
engines built ahead of time for RTX_TARGETS) hold one engine per capacity; their modules are
imported only by load_backend, so importing k3trt never needs either.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

BACKENDS = ("torch", "onnx", "tensorrt", "tensorrt-rtx")
ONNX_MODULES = ("onnxruntime", "onnxruntime_extensions")     # what the onnx backend runs on
MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx_bindings"}
INSTALL = {"onnx": "pip install onnxruntime onnxruntime-extensions",
           "tensorrt": "pip install 'k3trt[tensorrt]' (tensorrt>=10.8; needs NVIDIA's package index)",
           "tensorrt-rtx": "pip install tensorrt-rtx-cu13-libs==1.7.1.116 tensorrt-rtx-cu13-bindings==1.7.1.116"}
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")


class BackendError(RuntimeError):
    """A TensorRT backend that is unknown or not installed; the message says how to install it."""


@dataclass(frozen=True)
class Backend:
    name: str                        # "tensorrt" | "tensorrt-rtx"
    trt: Any = field(repr=False)     # the imported module
    version: str = ""

    @property
    def is_rtx(self) -> bool:
        return self.name == "tensorrt-rtx"


def installed_backends() -> list[str]:
    """TensorRT backends whose module can be found (without importing it)."""
    return [name for name, mod in MODULES.items() if importlib.util.find_spec(mod) is not None]


def load_backend(name: str) -> Backend:
    if name not in MODULES:
        raise BackendError(f"unknown TensorRT backend {name!r}; choose one of {sorted(MODULES)}")
    try:
        trt = importlib.import_module(MODULES[name])
    except ImportError as e:
        raise BackendError(f"backend {name!r} is not installed ({e}); install it with: {INSTALL[name]}") from None
    return Backend(name, trt, getattr(trt, "__version__", "?"))


def local_gpu_target() -> str | None:
    """This machine's GPU architecture as a target name (sm90), or None without a CUDA GPU."""
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
    except Exception:  # noqa: BLE001  (a broken CUDA setup: no GPU as far as we can tell)
        pass
    return None


def runnable_here(backend: str, target: str | None) -> str | None:
    """None if this machine could run `backend` engines built for `target`, else why not (one
    clause, for messages). TensorRT-family engines run only on the GPU architecture they were
    built for; TensorRT-RTX runs only on its RTX targets (on SM90, e.g. an H200, it refuses to
    deserialize: "compute capability 9.0 ... not supported"). onnx engine dirs run on any CPU with
    onnxruntime and onnxruntime-extensions."""
    if backend == "onnx":
        missing = [m for m in ONNX_MODULES if importlib.util.find_spec(m) is None]
        return f"{', '.join(missing)} not installed ({INSTALL['onnx']})" if missing else None
    local = local_gpu_target()
    if backend == "tensorrt-rtx" and local is not None and local not in RTX_TARGETS:
        return (f"its GPU is {local}, and TensorRT-RTX runs only on {', '.join(RTX_TARGETS)} "
                "(datacenter GPUs such as sm90 need --backend tensorrt or torch)")
    if local is None:
        return "it has no CUDA GPU (TensorRT engines run on the GPU they were built for)"
    if target is not None and local != target:
        return f"its GPU is {local} and the engines were built for {target} (an engine runs only on its target)"
    if backend in MODULES and importlib.util.find_spec(MODULES[backend]) is None:
        return f"{backend} is not installed ({INSTALL[backend]})"
    return None
