"""The engine directory: everything the runtime needs, described by one versioned config.json.

    ENGINE_DIR/config.json   {"format_version": 1, "k3trt_version", "backend", "target",
                              "model": the checkpoint's config.json (as read),
                              "build": BuildConfig, "capacities": builder.capacities.Capacities,
                              "files": {relative path: sha256 hex}}
    ENGINE_DIR/rank0/        backend files (torch: the checkpoint's config + safetensors shards)
    ENGINE_DIR/tokenizer/    tokenizer files + chat template (optional)

A directory is written under a temporary name beside the target (``.NAME.tmp-*``) and renamed
into place, so a crashed or killed build never leaves something that looks finished: the target
either does not exist, or is the previous complete engine dir. Rebuilding into an existing engine
dir renames the old one aside (``.NAME.old-*``) only once the new one is complete. A lock file
(``.NAME.lock``, flock) is held for the whole write: a second build into the same target is
refused, and leftovers of a killed build (``.NAME.tmp-*``, ``.NAME.old-*``) are removed, with a
warning, by the next build into that target. Reading checks the format version, the backend and
every listed file's checksum, and refuses with a message that says what to do.

``inputs`` (optional) records what the files were built from (builder/build.py: checkpoint file
hashes, k3trt version and code digest, one content key per capacity), so that a rebuild can
reuse the files of unchanged capacities.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import k3trt
from k3trt.builder.capacities import Capacities
from k3trt.config import ModelConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
BACKENDS = ("torch", "tensorrt", "tensorrt-rtx")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPES = ("auto", "bf16", "fp8")
_REBUILD = "rebuild it with `k3trt build CHECKPOINT --output DIR`"


class EngineDirError(ValueError):
    """An engine directory this runtime cannot use; the message says what to do."""


class EngineDirBusy(RuntimeError):
    """Another build is writing the same engine directory."""


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


def temp_prefix(output: Path) -> str:
    return f".{output.name}.tmp-"


def old_prefix(output: Path) -> str:
    return f".{output.name}.old-"


@contextlib.contextmanager
def build_lock(output: str | Path) -> Iterator[Path]:
    """Hold ``.NAME.lock`` beside `output` (an exclusive flock, released by the kernel when the
    process dies, even by SIGKILL), refusing if another build holds it; the file is removed on
    exit. Inside, leftovers of interrupted builds into `output` are removed."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    path = output.parent / f".{output.name}.lock"
    try:
        import fcntl
    except ImportError:            # not POSIX: no lock, no cleanup of leftovers (they are ignored)
        yield path
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise EngineDirBusy(f"another k3trt build (pid {owner}) is writing {output}; wait for it to finish, "
                                f"or stop it (a killed build leaves nothing that loads)") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)               # its previous holder removed it between our open and flock: again
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        remove_stale(output)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def remove_stale(output: Path) -> list[Path]:
    """Remove ``.NAME.tmp-*`` / ``.NAME.old-*`` beside `output` (call with the build lock held:
    then no live build owns them). Returns what was removed."""
    removed = []
    if not output.parent.is_dir():
        return removed
    for p in sorted(output.parent.iterdir()):
        if p.name.startswith((temp_prefix(output), old_prefix(output))) and p.is_dir() and not p.is_symlink():
            log.warning("removing %s: left behind by an interrupted build into %s", p, output)
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def is_engine_dir(path: Path) -> bool:
    return (path / CONFIG_NAME).is_file()


def write_engine_dir(output: str | Path, *, backend: str, target: str | None, model_raw: dict[str, Any],
                     build: BuildConfig, capacities: Capacities, populate: Callable[[Path], Any],
                     inputs: dict[str, Any] | None = None) -> Path:
    """`populate(tmp)` puts the backend and tokenizer files under tmp (and may return
    {relative path: sha256} of files it already verified, which are not hashed again); then every
    file is hashed, config.json written, and tmp renamed to `output`. `output` must not exist, be
    empty, or be an engine dir (which is replaced once the new one is complete; `populate` may
    read it until then). `inputs` is written into config.json after populate ran (populate may
    fill it in)."""
    output = Path(output)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {BACKENDS}")
    check_output(output)
    with build_lock(output):
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(output), dir=output.parent))
        try:
            known = populate(tmp) or {}
            files = {}
            for p in sorted(q for q in tmp.rglob("*") if q.is_file()):
                rel = p.relative_to(tmp).as_posix()
                if rel in known:
                    files[rel] = known[rel]
                    continue
                log.info("hashing %s (%.1f MiB)", rel, p.stat().st_size / 2**20)
                files[rel] = sha256_file(p)
            config = {"format_version": FORMAT_VERSION, "k3trt_version": k3trt.__version__, "backend": backend,
                      "target": target, "model": model_raw, "build": dataclasses.asdict(build),
                      "capacities": capacities.to_dict(),
                      "files": files}
            if inputs:
                config["inputs"] = inputs
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            _replace(tmp, output)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("engine dir written: %s (%s backend, %d files)", output, backend, len(files))
    return output


def check_output(output: Path) -> None:
    """Refuse an `output` a build must not replace: a file, or a non-empty directory that is not
    an engine dir."""
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a directory; choose a new --output directory")
    if output.is_dir() and any(output.iterdir()) and not is_engine_dir(output):
        raise FileExistsError(f"{output} exists, is not empty and is not an engine directory; "
                              "choose a new --output directory")


def _replace(tmp: Path, output: Path) -> None:
    """Rename the complete `tmp` to `output`. An existing engine dir is first renamed aside and
    removed after: a kill in between leaves no `output` and two complete dirs, which the next
    build removes (remove_stale); never a partial `output`."""
    if not output.exists():
        os.replace(tmp, output)
        return
    if not any(output.iterdir()):
        output.rmdir()
        os.replace(tmp, output)
        return
    check_output(output)           # still an engine dir: never move anything else aside
    old = output.parent / f"{old_prefix(output)}{os.getpid()}-{time.time_ns()}"
    os.rename(output, old)
    os.rename(tmp, output)
    log.info("replaced the previous engine dir %s", output)
    shutil.rmtree(old, ignore_errors=True)


def read_engine_dir(path: str | Path, *, backend: str | None = None, verify_checksums: bool = True) -> EngineDir:
    """Load and check an engine dir; `backend` is the backend the caller can run (None: any)."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise EngineDirError(f"{path} is not an engine directory (no {CONFIG_NAME}); {_REBUILD}")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{cfg_path} is not valid JSON ({e}); {_REBUILD}") from None
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineDirError(
            f"{path} has engine format version {version!r} (written by k3trt {raw.get('k3trt_version', '?')}); "
            f"this k3trt {k3trt.__version__} reads version {FORMAT_VERSION}: {_REBUILD}")
    got = raw.get("backend")
    if got not in BACKENDS:
        raise EngineDirError(f"{path}: unknown backend {got!r}; {_REBUILD}")
    if backend is not None and got != backend:
        if backend == "torch" and got in ("tensorrt", "tensorrt-rtx"):
            raise EngineDirError(_trt_refusal(path, got, raw.get("target")))
        raise EngineDirError(f"{path} was built for the {got!r} backend but this runtime runs {backend!r}: "
                             f"rebuild it with `k3trt build CHECKPOINT --output DIR --backend {backend}`")
    try:
        ed = EngineDir(path=path, backend=got, target=raw.get("target"),
                       model=ModelConfig.from_dict(raw["model"]), model_raw=raw["model"],
                       build=BuildConfig(**raw["build"]),
                       capacities=Capacities.from_dict(raw["capacities"]),
                       files=dict(raw["files"]), k3trt_version=raw.get("k3trt_version", "?"),
                       inputs=dict(raw.get("inputs") or {}))
    except (KeyError, TypeError, ValueError) as e:
        raise EngineDirError(f"{cfg_path} is malformed ({type(e).__name__}: {e}); {_REBUILD}") from None
    for rel, digest in ed.files.items():
        f = path / rel
        if not f.is_file():
            raise EngineDirError(f"{path}: file {rel} listed in {CONFIG_NAME} is missing (incomplete copy?); "
                                 f"copy the whole directory again or {_REBUILD}")
        if verify_checksums:
            log.info("verifying %s (%.1f MiB)", rel, f.stat().st_size / 2**20)
            if sha256_file(f) != digest:
                raise EngineDirError(f"{path}: checksum of {rel} does not match {CONFIG_NAME} (the file was "
                                     f"modified or corrupted); copy it again or {_REBUILD}")
    return ed


def _trt_refusal(path: Path, backend: str, target: str | None) -> str:
    """Why a torch runtime (LLM, `k3trt run`, `k3trt serve`) refuses a TensorRT engine dir: whether
    this machine could run it at all, and what to build instead."""
    from k3trt.builder.backends import runnable_here

    what = f"{path} was built for the {backend!r} backend (target {target or '?'})"
    fix = ("LLM, `k3trt run` and `k3trt serve` run torch engine dirs: build one with "
           "`k3trt build CHECKPOINT --output DIR --backend torch`")
    reason = runnable_here(backend, target)
    if reason is not None:
        return f"{what}, and this machine cannot run it: {reason}. {fix}"
    return (f"{what}; this machine could run it, but the TensorRT session (k3trt.runtime.trt_session) is not "
            f"wired into the runtime yet. {fix}")
