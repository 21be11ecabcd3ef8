"""Writing an engine directory atomically, under a build lock.

A directory is written under a temporary name beside the target (``.NAME.tmp-*``) and renamed
into place, so a crashed or killed build never leaves something that looks finished: the target
either does not exist, or is the previous complete engine dir. Rebuilding into an existing engine
dir renames the old one aside (``.NAME.old-*``) only once the new one is complete. A lock file
(``.NAME.lock``, flock) is held for the whole write: a second build into the same target is
refused, and leftovers of a killed build (``.NAME.tmp-*``, ``.NAME.old-*``) are removed, with a
warning, by the next build into that target. The config.json document and reading it back:
engine/engine_dir.py.

An engine dir owns its files: ``copy_owned`` puts a file from outside (the checkpoint's shards,
its tokenizer) into one as an independent copy (a reflink where the filesystem shares blocks
copy-on-write, else a kernel copy), never a hard link, so damage to the engine dir is never
damage to the checkpoint, nor the other way round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from k3trt.engine.backends import BACKENDS
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.engine.engine_dir import CONFIG_NAME, engine_config, is_engine_dir, sha256_file
from k3trt.parallel.config import ParallelConfig

log = logging.getLogger(__name__)


class EngineDirBusy(RuntimeError):
    """Another build is writing the same engine directory."""


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
        import fcntl  # noqa: PLC0415 (optional: POSIX only)
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


_FICLONE = 0x40049409          # linux/fs.h: share the source's blocks copy-on-write (btrfs, XFS, ...)


def copy_owned(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` (new) as a file of its own, with src's mode and times: a reflink where
    the filesystem supports it, else os.copy_file_range, else a plain copy. Never a hard link."""
    src, dst = Path(src), Path(dst)
    log.info("copying %s (%.1f MiB)", src.name, src.stat().st_size / 2**20)
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        if not _reflink(fin, fout):
            _kernel_copy(fin, fout)
    shutil.copystat(src, dst)


def _reflink(fin, fout) -> bool:
    try:
        import fcntl  # noqa: PLC0415 (optional: POSIX only)
        fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
    except (ImportError, OSError):
        return False
    return True


def _kernel_copy(fin, fout) -> None:
    size = os.fstat(fin.fileno()).st_size
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
            if n == 0:
                break
            done += n
        if done == size:
            return
    except (AttributeError, OSError):         # not Linux, or a filesystem pair it does not support
        pass
    fin.seek(0)
    fout.seek(0)
    fout.truncate()
    shutil.copyfileobj(fin, fout, 1 << 20)


def write_engine_dir(output: str | Path, *, backend: str, target: str | None, model_raw: dict[str, Any],
                     build: BuildConfig, capacities: Capacities, populate: Callable[[Path], Any],
                     inputs: dict[str, Any] | None = None, plugin_library: dict[str, Any] | None = None,
                     parallel: ParallelConfig | None = None) -> Path:
    """`populate(tmp)` puts the backend and tokenizer files under tmp (and may return
    {relative path: sha256} of files it already verified, which are not hashed again); then every
    file is hashed, config.json written, and tmp renamed to `output`. `output` must not exist, be
    empty, or be an engine dir (which is replaced once the new one is complete; `populate` may
    read it until then). `inputs` is written into config.json after populate ran (populate may
    fill it in). `plugin_library`: the record of the plugin library the engines contain
    (loader.PluginLibrary.record). `parallel`: the layout of a multi-rank engine (one rank{r}/
    per rank under tmp)."""
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
            config = engine_config(backend=backend, target=target, model_raw=model_raw, build=build,
                                   capacities=capacities, files=files, inputs=inputs,
                                   plugin_library=plugin_library, parallel=parallel)
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
