"""Build the plugin library (src/*.cu, nvcc) and the harness shim (harness/harness.cpp, g++), each
with one call, cached by a content hash of its sources, the compiler, the TensorRT headers' version
and the flags, under ``$K3TRT_CACHE`` (default ``~/.cache/k3trt``) / ``trt_plugin``.

Headers: TensorRT's public C++ headers are never copied into the repository; the include directory
is ``$K3TRT_TRT_INCLUDE``, else ``shared/third_party/tensorrt/include`` beside the repository root.
A user points ``K3TRT_TRT_INCLUDE`` at their TensorRT installation's ``include``.

    python -m k3trt.trt_plugin.build [--arch sm_120 ...] [--force] [--harness]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
HARNESS_SOURCE = HERE / "harness" / "harness.cpp"
# the torch op's SM90 MLA kernels and their launcher (k3trt/plugins/mla_cuda/), compiled into the
# library's sm_90a part: MlaVerify runs them on SM90 (the plain kernel elsewhere)
MLA_SM90_DIR = HERE.parent / "plugins" / "mla_cuda"
MLA_SM90_SOURCES = ("launch.cu", "pair.cu", "swap.cu", "merge.cu")
MLA_SM90_ARCH = "sm_90a"
INCLUDE_ENV = "K3TRT_TRT_INCLUDE"
CACHE_ENV = "K3TRT_CACHE"
# full TensorRT on H100/H200 and TensorRT-RTX's first target, in one fatbin
DEFAULT_ARCHS = ("sm_90a", "sm_120")
NVCC_FLAGS = ("-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden,-Wno-deprecated-declarations")
GXX_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-Wno-deprecated-declarations")


class PluginBuildError(RuntimeError):
    """The library cannot be built here; the message names what is missing and the remedy."""


def trt_include_dir() -> Path:
    """The TensorRT include directory (must hold NvInferRuntime.h)."""
    env = os.environ.get(INCLUDE_ENV)
    path = Path(env) if env else HERE.parents[2] / "shared" / "third_party" / "tensorrt" / "include"
    if not (path / "NvInferRuntime.h").is_file():
        raise PluginBuildError(
            f"TensorRT headers not found: {path}/NvInferRuntime.h is missing "
            f"({'from ' + INCLUDE_ENV if env else INCLUDE_ENV + ' is unset, so the default beside the repository'}). "
            f"Set {INCLUDE_ENV} to the include directory of a TensorRT installation (10.8+ or 11.x).")
    return path


def _tool(name: str) -> Path:
    found = shutil.which(name)
    if not found and name == "nvcc":
        for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if home and (Path(home) / "bin" / "nvcc").is_file():
                found = str(Path(home) / "bin" / "nvcc")
                break
    if not found:
        remedy = ("install the CUDA toolkit (12.8+ for sm_120) and put nvcc on PATH or set CUDA_HOME"
                  if name == "nvcc" else "install a C++17 compiler (g++)")
        raise PluginBuildError(f"{name} not found: {remedy}")
    return Path(found)


def _cuda_include() -> Path:
    """The CUDA toolkit's include directory (TensorRT's headers include cuda_runtime_api.h)."""
    nvcc = _tool("nvcc").resolve()
    homes = [os.environ.get("CUDA_HOME"), nvcc.parents[1], "/usr/local/cuda"]
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return Path(home) / "include"
    raise PluginBuildError(f"cuda_runtime_api.h not found under {[str(h) for h in homes if h]}: set CUDA_HOME "
                           "to the CUDA toolkit")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "k3trt") / "trt_plugin"


def normalize_arch(arch: str) -> str:
    """'sm_90a' | 'sm90a' | '90a' | 'sm120' -> 'sm_90a' / 'sm_120'."""
    digits = arch.lower().removeprefix("sm").removeprefix("_")
    if not digits[:2].isdigit():
        raise ValueError(f"GPU architecture {arch!r}: expected sm_XY (e.g. sm_90a, sm_120)")
    return f"sm_{digits}"


def _gencode(arch: str) -> list[str]:
    num = normalize_arch(arch).removeprefix("sm_")
    return ["-gencode", f"arch=compute_{num},code=sm_{num}"]


def _digest(files: list[Path], *extra: str) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(HERE.parent).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    for e in extra:
        h.update(e.encode() + b"\0")
    return h.hexdigest()[:16]


def _version(tool: Path) -> str:
    return subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=False).stdout


def _compile(cmd: list[str], target: Path, what: str) -> Path:
    """Run `cmd` writing to a temporary name (its last argument), then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    t0 = time.perf_counter()
    log.info("building %s: %s", what, " ".join(cmd[:1] + ["..."] + cmd[-3:]))
    try:
        r = subprocess.run([*cmd, tmp], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise PluginBuildError(f"{what} failed to compile ({cmd[0]} exit {r.returncode}):\n{r.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("built %s in %.1fs: %s", what, time.perf_counter() - t0, target)
    return target


def library_sources() -> list[Path]:
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".cu", ".h"))


def mla_sm90_sources() -> list[Path]:
    return sorted(p for p in MLA_SM90_DIR.iterdir() if p.suffix in (".cu", ".cuh", ".h") and p.name != "binding.cpp")


def build_library(archs: tuple[str, ...] | list[str] = DEFAULT_ARCHS, *, force: bool = False) -> Path:
    """The plugin library (.so) for `archs`, built now or taken from the cache. With sm_90a among
    them, the SM90 MLA kernels (MLA_SM90_SOURCES) are compiled for sm_90a alone and linked in."""
    from k3trt.plugins.mla_cuda import constants  # noqa: PLC0415 (the generated header's text)

    include, nvcc = trt_include_dir(), _tool("nvcc")
    archs = tuple(normalize_arch(a) for a in archs)
    sm90 = MLA_SM90_ARCH in archs
    gencode = [flag for a in archs for flag in _gencode(a)]
    flags = [*NVCC_FLAGS, f"--threads={min(2, len(archs))}", *gencode]
    files = library_sources() + (mla_sm90_sources() if sm90 else [])
    key = _digest(files, *flags, _version(nvcc), (include / "NvInferVersion.h").read_text(),
                  constants.header() if sm90 else "")
    target = cache_dir() / f"libk3trt_plugins-{'-'.join(a.removeprefix('sm_') for a in archs)}-{key}.so"
    if target.is_file() and not force:
        log.debug("plugin library cached: %s", target)
        return target
    sources = [str(f) for f in library_sources() if f.suffix == ".cu"]
    if not sm90:
        cmd = [str(nvcc), *flags, "-I", str(include), *sources, "-o"]
        return _compile(cmd, target, f"the k3trt plugin library ({len(files)} sources, {', '.join(archs)})")
    with tempfile.TemporaryDirectory(prefix="k3trt-mla-sm90-") as tmp:
        generated = constants.write_header(tmp)
        mla = ["-I", str(MLA_SM90_DIR), "-I", generated, "-DK3TRT_MLA_SM90"]
        objects = [_object(nvcc, MLA_SM90_DIR / name, Path(tmp), mla) for name in MLA_SM90_SOURCES]
        cmd = [str(nvcc), *flags, "-I", str(include), *mla, *sources, *(str(o) for o in objects), "-o"]
        return _compile(cmd, target, f"the k3trt plugin library ({len(files)} sources, {', '.join(archs)}, "
                                     "the SM90 MLA kernels)")


def _object(nvcc: Path, source: Path, out_dir: Path, includes: list[str]) -> Path:
    """One SM90 MLA source compiled for sm_90a alone (wgmma has no other target)."""
    obj = out_dir / f"{source.stem}.o"
    cmd = [str(nvcc), "-std=c++17", "-O3", "-c", "-Xcompiler", "-fPIC,-fvisibility=hidden",
           *_gencode(MLA_SM90_ARCH), *includes, str(source), "-o", str(obj)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise PluginBuildError(f"{source.name} (SM90 MLA kernel) failed to compile for {MLA_SM90_ARCH} "
                               f"(nvcc exit {r.returncode}):\n{r.stderr[-4000:]}")
    log.info("compiled %s for %s in %.1fs", source.name, MLA_SM90_ARCH, time.perf_counter() - t0)
    return obj


def build_harness(*, force: bool = False) -> Path:
    """The harness shim (.so, no CUDA code: it only needs cuda_runtime_api.h's types)."""
    include, gxx, cuda_include = trt_include_dir(), _tool("g++"), _cuda_include()
    flags = list(GXX_FLAGS)
    key = _digest([HARNESS_SOURCE], *flags, _version(gxx), (include / "NvInferVersion.h").read_text())
    target = cache_dir() / f"libk3trt_plugin_harness-{key}.so"
    if target.is_file() and not force:
        return target
    cmd = [str(gxx), *flags, "-I", str(include), "-I", str(cuda_include), str(HARNESS_SOURCE), "-ldl", "-o"]
    return _compile(cmd, target, "the plugin harness")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3trt.trt_plugin.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help=f"GPU architecture (repeatable; default {' '.join(DEFAULT_ARCHS)})")
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--harness", action="store_true", help="also build the harness shim")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_library(tuple(args.arch or DEFAULT_ARCHS), force=args.force))
    if args.harness:
        print(build_harness(force=args.force))


if __name__ == "__main__":
    main()
