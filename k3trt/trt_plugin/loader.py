"""The plugin library inside a TensorRT process: the architectures an engine target needs, the
library built (or taken from the cache) for them, the record an engine dir keeps of it, and
loading it into a backend's plugin registry.

TensorRT-RTX's ONNX parser ``dlopen``s ``libtensorrt_rtx.so`` by that bare name when it imports a
plugin node; the wheel ships only ``libtensorrt_rtx.so.1``, and the failed ``dlopen`` aborts the
process (docs/trt_plugins.md). glibc's ``dlopen`` matches a bare name against the ``DT_SONAME`` of
the objects already loaded, so a shim with no code whose SONAME is ``libtensorrt_rtx.so`` and
which depends on the wheel's ``libtensorrt_rtx.so.1``, loaded ``RTLD_GLOBAL`` before the first
parse, resolves the name in this process to the library already mapped: no ``LD_LIBRARY_PATH``,
no subprocess, nothing written into the wheel. (A symlink loaded by path does not: its SONAME is
still ``libtensorrt_rtx.so.1``.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3trt.trt_plugin.build import (
    _compile,
    _tool,
    build_library,
    cache_dir,
    normalize_arch,
)

log = logging.getLogger(__name__)

NAMESPACE, VERSION = "k3trt", "1"
# the plugins a step graph's k3trt nodes name (MergeAttnStates: DCP graphs only, loaded all the same)
OP_TYPES = ("MergeAttnStates", "MlaVerify", "MlaCacheWrite", "KdaRecurrent", "KdaChunked", "ShortConv", "MoeExperts")
# engine target -> the nvcc architecture its kernels compile for (sm90: the arch-specific variant)
TARGET_ARCH = {"sm90": "sm_90a"}
LIBRARY_ENV = "K3TRT_PLUGIN_LIBRARY"
RTX_NAME = "libtensorrt_rtx.so"


class PluginLibraryError(RuntimeError):
    """An engine's plugin library is missing, different, or cannot be loaded; the message says
    the command that fixes it."""


@dataclass(frozen=True)
class PluginLibrary:
    path: Path
    sha256: str
    archs: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        """What an engine dir's config.json keeps (build block, ``plugin_library``)."""
        return {"file": self.path.name, "sha256": self.sha256, "archs": list(self.archs)}


def target_archs(target: str) -> tuple[str, ...]:
    """The nvcc architectures for an engine target (``sm120`` -> ``sm_120``, ``sm90`` -> ``sm_90a``)."""
    t = target.lower().replace("_", "")
    return (TARGET_ARCH.get(t) or normalize_arch(t),)


def rebuild_command(archs) -> str:
    return f"k3trt build-plugins --arch {','.join(a.replace('_', '') for a in archs)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def library_for(archs: tuple[str, ...] | list[str]) -> PluginLibrary:
    """The library for `archs`, built now or taken from the cache (trt_plugin/build.py)."""
    archs = tuple(normalize_arch(a) for a in archs)
    path = build_library(archs)
    return PluginLibrary(path, _sha256(path), archs)


def find_library(record: dict[str, Any]) -> Path:
    """The library an engine dir's `record` names, checked: ``$K3TRT_PLUGIN_LIBRARY`` if set, else
    the file of that name in the build cache. Raises PluginLibraryError (missing, or a different
    sha256) with the command that builds it."""
    archs = record.get("archs") or ["sm_120"]
    env = os.environ.get(LIBRARY_ENV)
    path = Path(env) if env else cache_dir() / record.get("file", "?")
    fix = (f"build it with `{rebuild_command(archs)}` (sources of the k3trt version that built the engines), "
           f"or set {LIBRARY_ENV} to that library, or rebuild the engines")
    if not path.is_file():
        raise PluginLibraryError(f"the engines need the k3trt plugin library {record.get('file')} "
                                 f"(sha256 {record.get('sha256', '?')[:16]}...), and {path} is missing; {fix}")
    got = _sha256(path)
    if got != record.get("sha256"):
        raise PluginLibraryError(f"the k3trt plugin library {path} differs from the one the engines were built "
                                 f"with (sha256 {got[:16]}... vs {str(record.get('sha256'))[:16]}...); {fix}")
    return path


def rtx_name_shim() -> Path:
    """The ``libtensorrt_rtx.so`` SONAME shim (module doc), linked against the installed wheel's
    library; cached by that library's path and size."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        raise PluginLibraryError("TensorRT-RTX is not installed: pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
                                 "tensorrt-rtx-cu13-bindings==1.7.1.116")
    libs = Path(next(iter(spec.submodule_search_locations)))
    real = libs / f"{RTX_NAME}.1"
    key = hashlib.sha256(f"{real}\0{real.stat().st_size}".encode()).hexdigest()[:16]
    target = cache_dir() / f"rtx_name_shim-{key}.so"
    if target.is_file():
        return target
    cmd = [str(_tool("g++")), "-shared", "-fPIC", f"-Wl,-soname,{RTX_NAME}", "-Wl,--no-as-needed", "-x", "c++",
           "/dev/null", f"-L{libs}", f"-l:{real.name}", f"-Wl,-rpath,{libs}", "-o"]
    return _compile(cmd, target, f"the {RTX_NAME} name shim")


def load_into(trt, library: Path, *, rtx: bool) -> None:
    """Load `library` into the plugin registry of the TensorRT module `trt`, unless its k3trt
    creators are registered already (the first library loaded in a process serves it), and check
    that every k3trt plugin is there; for TensorRT-RTX, first make ``libtensorrt_rtx.so`` resolvable."""
    if rtx:
        preload_rtx_name()
    registry = trt.get_plugin_registry()
    if _missing(registry):
        if registry.load_library(str(library)) is None:
            raise PluginLibraryError(f"TensorRT could not load the plugin library {library} (the log above has "
                                     "the reason)")
        log.info("k3trt plugin library loaded: %s", library)
    missing = _missing(registry)
    if missing:
        raise PluginLibraryError(f"the plugin library {library} registers no creator for {missing} "
                                 f"(namespace {NAMESPACE}, version {VERSION})")


def _missing(registry) -> list[str]:
    return [op for op in OP_TYPES if registry.get_creator(op, VERSION, NAMESPACE) is None]


@functools.cache
def preload_rtx_name() -> None:
    """Load rtx_name_shim ``RTLD_GLOBAL`` (once per process), before the first parse of a plugin node."""
    ctypes.CDLL(str(rtx_name_shim()), mode=os.RTLD_GLOBAL)

