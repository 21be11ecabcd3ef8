"""Kernel-or-reference choice shared by every plugin op's CUDA registration.

    dispatch.call(op, reason, "module.function", reference, *args)

``reason`` is the op's ``<op>_unsupported(...)`` answer (None: the kernel takes the call). With a
reason, the op logs it once per (op, reason) and runs ``reference(*args)``; without, it imports
``k3trt.plugins.<module>`` (the first time only) and runs ``<module>.<function>(*args)``. An op
that chooses among several kernels (mla_verify) uses the two halves, ``falls_back`` and
``kernel_module``. Kernel
modules import triton or build a CUDA extension, so they are imported only here, on a CUDA call:
importing k3trt never needs triton.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any, Callable

log = logging.getLogger(__name__)


def kernel_module(name: str) -> ModuleType:
    """``k3trt.plugins.<name>``, imported on first use."""
    return importlib.import_module(f"{__package__}.{name}")


@functools.lru_cache(maxsize=256)
def log_fallback(op: str, reason: str) -> None:
    """One warning per (op, reason): a step loop would otherwise repeat it every layer and step."""
    log.warning("%s: Triton kernel does not cover %s; using the torch reference", op, reason)


def falls_back(op: str, reason: str | None) -> bool:
    """Whether the call takes the reference (`reason` set), logging why once per (op, reason)."""
    if reason:
        log_fallback(op, reason)
    return bool(reason)


def call(op: str, reason: str | None, kernel: str, reference: Callable, *args: Any) -> Any:
    """The kernel ``"module.function"`` on `args`, or `reference` on them when `reason` is set."""
    if falls_back(op, reason):
        return reference(*args)
    module, function = kernel.rsplit(".", 1)
    return getattr(kernel_module(module), function)(*args)
