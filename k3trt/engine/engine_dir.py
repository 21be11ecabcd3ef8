"""The engine directory: everything the runtime needs, described by one versioned config.json.

    ENGINE_DIR/config.json   {"format_version": 3, "k3trt_version", "backend", "target",
                              "model": the checkpoint's config.json (as read),
                              "build": BuildConfig (+ "plugin_library"), "capacities": Capacities,
                              "parallel": {"tp", "dcp", "ep", "dcp_interleave"},
                              "files": {relative path: sha256 hex}, "inputs" (optional),
                              "config_sha256": digest of all the above (config_digest)}
    ENGINE_DIR/rank0/        backend files (torch: copies of the checkpoint's config + shards)
    ENGINE_DIR/rank{r}/      a multi-rank torch engine (world size max(tp, dcp, ep) > 1): one per
                             rank, each a checkpoint of that rank's slices only (model/rank_checkpoint.py)
    ENGINE_DIR/tokenizer/    tokenizer files + chat template (optional)

This module reads and verifies a directory (``read_engine_dir``) and owns the config.json
document (``engine_config``); writing one atomically under the build lock is engine/writer.py.
Reading checks, in order: the format version; config.json's own digest (an edited model, build,
capacities or files block is refused); the backend; the parallel block against the model; that
every ``rank{r}/config.json`` (what the torch loader reads) equals the model block; that every
file in the directory is listed (an unlisted or symlinked file is refused, by name); every listed
file's checksum (``rank=r``: only the shared files' and rank r's, so that a rank reads only its
own weights). Each refusal says what to
do. The engine dir owns its files (builder/build.py copies the checkpoint's), so rebuilding
from the checkpoint is always a correct remedy for a damaged engine dir.

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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k3trt
from k3trt.config import ModelConfig
from k3trt.engine.backends import BACKENDS, runnable_here
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.parallel.config import ParallelConfig, ParallelConfigError
from k3trt.trt_plugin.loader import PluginLibraryError, find_library

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
CONFIG_NAME = "config.json"
DIGEST_KEY = "config_sha256"
REBUILD = "rebuild it with `k3trt build CHECKPOINT --output DIR`"
# a damaged file or config.json: the build made its own copies, so the checkpoint is still good
REBUILD_DAMAGED = (f"{REBUILD} (the checkpoint is untouched: an engine dir holds its own copies of the "
                   "checkpoint's files)")


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
    parallel: ParallelConfig = ParallelConfig()            # the ranks the weights are split over (rank 0's view)

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
        return self.rank_path(0)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def rank_path(self, rank: int) -> Path:
        """The directory of rank `rank`'s files (a multi-rank torch engine: its slices of the weights)."""
        if not 0 <= rank < self.world_size:
            raise EngineDirError(f"{self.path} holds ranks 0..{self.world_size - 1} ({self.parallel_text()}); "
                                 f"there is no rank {rank}")
        return self.path / f"rank{rank}"

    def layout(self, **asked: int | None) -> ParallelConfig:
        """The layout to run with run-time options (tp, dcp, ep, dcp_interleave; None: not given): a
        split engine dir's own, and options that differ from it are refused (its rank dirs hold
        fixed slices); an unsplit one runs any layout the options ask for (the loader slices the
        whole checkpoint)."""
        given = {k: v for k, v in asked.items() if v is not None}
        if self.world_size == 1:
            return ParallelConfig(**given)
        for name, value in given.items():
            if value != getattr(self.parallel, name):
                flag = f"--{name.replace('_', '-')}"
                raise EngineDirError(
                    f"{flag} {value}: {self.path} was built for {self.parallel_text()} (its rank dirs hold those "
                    f"slices); drop {flag}, or build an engine dir for this layout: "
                    f"`k3trt build CHECKPOINT --output DIR --backend torch {flag} {value} ...`")
        return self.parallel

    def parallel_text(self) -> str:
        pc = self.parallel
        return f"tp={pc.tp} dcp={pc.dcp} ep={pc.ep} dcp_interleave={pc.dcp_interleave}"

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


def config_digest(doc: dict[str, Any]) -> str:
    """sha256 of a config.json document's canonical JSON (sorted keys, no whitespace), without
    its own DIGEST_KEY: what the build records and every read checks."""
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def engine_config(*, backend: str, target: str | None, model_raw: dict[str, Any], build: BuildConfig,
                  capacities: Capacities, files: dict[str, str], inputs: dict[str, Any] | None = None,
                  plugin_library: dict[str, Any] | None = None, parallel: ParallelConfig | None = None) -> dict:
    """The config.json document of an engine dir (what read_engine_dir parses back)."""
    build_doc = dataclasses.asdict(build)
    if plugin_library is not None:
        build_doc["plugin_library"] = dict(plugin_library)
    config = {"format_version": FORMAT_VERSION, "k3trt_version": k3trt.__version__, "backend": backend,
              "target": target, "model": model_raw, "build": build_doc,
              "capacities": capacities.to_dict(), "parallel": parallel_doc(parallel or ParallelConfig()),
              "files": files}
    if inputs:
        config["inputs"] = inputs
    config[DIGEST_KEY] = config_digest(config)
    return config


def parallel_doc(pc: ParallelConfig) -> dict[str, int]:
    """config.json's parallel block: the layout, not a rank."""
    return {"tp": pc.tp, "dcp": pc.dcp, "ep": pc.ep, "dcp_interleave": pc.dcp_interleave}


def read_engine_dir(path: str | Path, *, backend: str | None = None, verify_checksums: bool = True,
                    rank: int | None = None) -> EngineDir:
    """Load and check an engine dir; `backend` is the backend the caller can run (None: any).
    `rank`: the caller is that rank of a multi-rank engine and verifies the checksums of the
    shared files and its own rank dir only (None: every file)."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise EngineDirError(f"{path} is not an engine directory (no {CONFIG_NAME}); {REBUILD}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineDirError(f"{cfg_path} is not valid JSON ({e}); {REBUILD_DAMAGED}") from None
    if not isinstance(raw, dict):
        raise EngineDirError(f"{cfg_path} is not a JSON object; {REBUILD_DAMAGED}")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineDirError(
            f"{path} has engine format version {version!r} (written by k3trt {raw.get('k3trt_version', '?')}); "
            f"this k3trt {k3trt.__version__} reads version {FORMAT_VERSION}: {REBUILD}")
    _check_digest(cfg_path, raw)
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
                       inputs=dict(raw.get("inputs") or {}), parallel=ParallelConfig(**raw["parallel"]))
    except (KeyError, TypeError, ValueError) as e:
        raise EngineDirError(f"{cfg_path} is malformed ({type(e).__name__}: {e}); {REBUILD}") from None
    _check_parallel(ed)
    if rank is not None:
        ed.rank_path(rank)              # refuses a rank the engine does not have
    _check_listing(ed)
    others = {f"rank{r}/" for r in range(ed.world_size) if r != rank} if rank is not None else set()
    for rel, digest in ed.files.items():
        f = path / rel
        if not f.is_file():
            raise EngineDirError(f"{path}: file {rel} listed in {CONFIG_NAME} is missing (incomplete copy?); "
                                 f"copy the whole directory again from an intact engine dir, or {REBUILD_DAMAGED}")
        if verify_checksums and not rel.startswith(tuple(others)):
            log.info("verifying %s (%.1f MiB)", rel, f.stat().st_size / 2**20)
            if sha256_file(f) != digest:
                raise EngineDirError(f"{path}: checksum of {rel} does not match {CONFIG_NAME} (the file was "
                                     f"modified or corrupted); copy the whole directory again from an intact "
                                     f"engine dir, or {REBUILD_DAMAGED}")
    _check_rank_config(ed)
    if verify_checksums:            # the plugin library is part of the engines: refuse it missing or changed
        ed.plugin_library_path()
    return ed


def _check_digest(cfg_path: Path, raw: dict[str, Any]) -> None:
    """config.json is covered by its own digest: an edit anywhere in it is refused."""
    recorded = raw.get(DIGEST_KEY)
    if not isinstance(recorded, str):
        raise EngineDirError(f"{cfg_path} is malformed (no {DIGEST_KEY!r} field: it was not written by "
                             f"`k3trt build`); {REBUILD}")
    if recorded != config_digest(raw):
        raise EngineDirError(f"{cfg_path} was edited after the build (its content does not match its "
                             f"{DIGEST_KEY}): the model, build, capacities and files blocks describe the files "
                             f"as built and cannot be changed in place; restore {CONFIG_NAME} from an intact "
                             f"copy of the engine dir, or {REBUILD_DAMAGED}; to change a build option, "
                             f"build again with it")


def _check_listing(ed: EngineDir) -> None:
    """Every file in the directory is config.json or listed in its files block; nothing is a
    symbolic link (an engine dir owns its files)."""
    linked, unlisted = [], []
    for root, dirs, names in os.walk(ed.path):
        for name in [*dirs, *names]:
            p = Path(root) / name
            rel = p.relative_to(ed.path).as_posix()
            if p.is_symlink():
                linked.append(rel)
            elif name in names and rel != CONFIG_NAME and rel not in ed.files:
                unlisted.append(rel)
    if linked:
        raise EngineDirError(f"{ed.path}: {', '.join(sorted(linked))} is a symbolic link; an engine dir holds its "
                             f"own files: copy the directory with its files (`cp -rL`), or {REBUILD}")
    if unlisted:
        raise EngineDirError(f"{ed.path}: {', '.join(sorted(unlisted))} not listed in {CONFIG_NAME} (added after "
                             f"the build); an engine dir holds only the files its build listed: remove "
                             f"{'them' if len(unlisted) > 1 else 'it'}, or {REBUILD_DAMAGED}")


def _check_parallel(ed: EngineDir) -> None:
    """A multi-rank engine is a torch engine whose layout fits its model, with a directory per
    rank and none beyond."""
    if ed.world_size > 1 and ed.backend != "torch":
        raise EngineDirError(f"{ed.path}: a {ed.backend} engine split over {ed.world_size} ranks "
                             f"({ed.parallel_text()}); only torch engines run on several ranks: {REBUILD}")
    try:
        ed.parallel.validate(ed.model)
    except ParallelConfigError as e:
        raise EngineDirError(f"{ed.path}: its parallel block does not fit its model: {e}; {REBUILD}") from None
    ranks = {rel.split("/", 1)[0] for rel in ed.files if rel.startswith("rank")}
    want = {f"rank{r}" for r in range(ed.world_size)}
    if ranks - want or (ed.backend == "torch" and want - ranks):
        raise EngineDirError(f"{ed.path}: its files block lists rank dirs {sorted(ranks)} but the engine has "
                             f"{ed.world_size} rank(s) ({ed.parallel_text()}); {REBUILD_DAMAGED}")


def _check_rank_config(ed: EngineDir) -> None:
    """The torch loader reads rank{r}/config.json; the runtime's model settings are the model
    block: they must be one document."""
    for r in range(ed.world_size):
        rel = f"rank{r}/{CONFIG_NAME}"
        if rel not in ed.files:
            continue
        try:
            same = json.loads((ed.path / rel).read_text()) == ed.model_raw
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            same = False
        if not same:
            raise EngineDirError(f"{ed.path}: {rel} differs from the model block of {CONFIG_NAME}; "
                                 f"{REBUILD_DAMAGED}")


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
