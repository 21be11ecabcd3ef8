"""The engine directory: everything the runtime needs, described by one versioned config.json.

    ENGINE_DIR/config.json   {"format_version": 1, "k3trt_version", "backend", "target",
                              "model": the checkpoint's config.json (as read),
                              "build": BuildConfig (+ "plugin_library"), "capacities": Capacities,
                              "files": {relative path: sha256 hex}, "inputs" (optional)}
    ENGINE_DIR/rank0/        backend files (torch: the checkpoint's config + safetensors shards)
    ENGINE_DIR/tokenizer/    tokenizer files + chat template (optional)

This module reads and verifies a directory (``read_engine_dir``) and owns the config.json
document (``engine_config``); writing one atomically under the build lock is engine/writer.py.
Reading checks the format version, the backend and every listed file's checksum, and refuses
with a message that says what to do.

``build.plugin_library`` (engines with k3trt plugin layers) names the plugin library the engines
were built with: {"file", "sha256", "archs"}. Reading such a dir finds that library
(trt_plugin/loader.find_library: ``$K3TRT_PLUGIN_LIBRARY``, else the build cache) and refuses
it missing or different, with the ``k3trt build-plugins`` command that builds it.

``inputs`` (optional) records what the files were built from (builder/build.py: checkpoint file
hashes, k3trt version and code digest, one content key per capacity), so that a rebuild can
reuse the files of unchanged capacities.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k3trt
from k3trt.config import ModelConfig
from k3trt.engine.backends import BACKENDS, runnable_here
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.trt_plugin.loader import PluginLibraryError, find_library

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
REBUILD = "rebuild it with `k3trt build CHECKPOINT --output DIR`"


class EngineDirError(ValueError):
    """An engine directory this runtime cannot use; the message says what to do."""


@dataclass(frozen=True)
class EngineDir:
    path: Path
    backend: str
    target: str | None
    model: ModelConfig
    model_raw: dict[str, Any]      # the checkpoint's config.json, kept verbatim
    build: BuildConfig
    capacities: Capacities
    files: dict[str, str]
    k3trt_version: str
    inputs: dict[str, Any] = field(default_factory=dict)   # what the build was made from (see module doc)
    plugin_library: dict[str, Any] | None = None           # the plugin library's record (see module doc)

    def plugin_library_path(self) -> Path | None:
        """The engines' plugin library on this machine, checked (EngineDirError if missing or
        different), or None for engines without plugins."""
        if self.plugin_library is None:
            return None
        try:
            return find_library(self.plugin_library)
        except PluginLibraryError as e:
            raise EngineDirError(f"{self.path}: {e}") from None

    @property
    def rank_dir(self) -> Path:
        return self.path / "rank0"

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.path / "tokenizer"
        return d if d.is_dir() else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_engine_dir(path: Path) -> bool:
    return (path / CONFIG_NAME).is_file()


def engine_config(*, backend: str, target: str | None, model_raw: dict[str, Any], build: BuildConfig,
                  capacities: Capacities, files: dict[str, str], inputs: dict[str, Any] | None = None,
                  plugin_library: dict[str, Any] | None = None) -> dict:
    """The config.json document of an engine dir (what read_engine_dir parses back)."""
    build_doc = dataclasses.asdict(build)
    if plugin_library is not None:
        build_doc["plugin_library"] = dict(plugin_library)
    config = {"format_version": FORMAT_VERSION, "k3trt_version": k3trt.__version__, "backend": backend,
              "target": target, "model": model_raw, "build": build_doc,
              "capacities": capacities.to_dict(), "files": files}
    if inputs:
        config["inputs"] = inputs
    return config


def read_engine_dir(path: str | Path, *, backend: str | None = None, verify_checksums: bool = True) -> EngineDir:
    """Load and check an engine dir; `backend` is the backend the caller can run (None: any)."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise EngineDirError(f"{path} is not an engine directory (no {CONFIG_NAME}); {REBUILD}")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{cfg_path} is not valid JSON ({e}); {REBUILD}") from None
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineDirError(
            f"{path} has engine format version {version!r} (written by k3trt {raw.get('k3trt_version', '?')}); "
            f"this k3trt {k3trt.__version__} reads version {FORMAT_VERSION}: {REBUILD}")
    got = raw.get("backend")
    if got not in BACKENDS:
        raise EngineDirError(f"{path}: unknown backend {got!r}; {REBUILD}")
    if backend is not None and got != backend:
        if backend == "torch" and got in ("tensorrt", "tensorrt-rtx"):
            raise EngineDirError(_trt_refusal(path, got, raw.get("target")))
        raise EngineDirError(f"{path} was built for the {got!r} backend but this runtime runs {backend!r}: "
                             f"rebuild it with `k3trt build CHECKPOINT --output DIR --backend {backend}`")
    try:
        build = dict(raw["build"])
        plugin_library = build.pop("plugin_library", None)
        ed = EngineDir(path=path, backend=got, target=raw.get("target"),
                       model=ModelConfig.from_dict(raw["model"]), model_raw=raw["model"],
                       build=BuildConfig(**build), plugin_library=plugin_library,
                       capacities=Capacities.from_dict(raw["capacities"]),
                       files=dict(raw["files"]), k3trt_version=raw.get("k3trt_version", "?"),
                       inputs=dict(raw.get("inputs") or {}))
    except (KeyError, TypeError, ValueError) as e:
        raise EngineDirError(f"{cfg_path} is malformed ({type(e).__name__}: {e}); {REBUILD}") from None
    for rel, digest in ed.files.items():
        f = path / rel
        if not f.is_file():
            raise EngineDirError(f"{path}: file {rel} listed in {CONFIG_NAME} is missing (incomplete copy?); "
                                 f"copy the whole directory again or {REBUILD}")
        if verify_checksums:
            log.info("verifying %s (%.1f MiB)", rel, f.stat().st_size / 2**20)
            if sha256_file(f) != digest:
                raise EngineDirError(f"{path}: checksum of {rel} does not match {CONFIG_NAME} (the file was "
                                     f"modified or corrupted); copy it again or {REBUILD}")
    if verify_checksums:            # the plugin library is part of the engines: refuse it missing or changed
        ed.plugin_library_path()
    return ed


def _trt_refusal(path: Path, backend: str, target: str | None) -> str:
    """Why a torch runtime (LLM, `k3trt run`, `k3trt serve`) refuses a TensorRT engine dir: whether
    this machine could run it at all, and what to build instead."""
    what = f"{path} was built for the {backend!r} backend (target {target or '?'})"
    fix = ("LLM, `k3trt run` and `k3trt serve` run torch engine dirs: build one with "
           "`k3trt build CHECKPOINT --output DIR --backend torch`")
    reason = runnable_here(backend, target)
    if reason is not None:
        return f"{what}, and this machine cannot run it: {reason}. {fix}"
    return (f"{what}; this machine could run it, but the TensorRT session (k3trt.runtime.trt_session) is not "
            f"wired into the runtime yet. {fix}")
