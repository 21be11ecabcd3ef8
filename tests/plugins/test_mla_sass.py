"""The SM90 MLA kernels' SASS keeps its wgmmas asynchronous: ptxas may serialise them (a full
`WARPGROUP.DEPBAR.LE gsb0, 0x0` right after each HGMMA or QGMMA, the fp8 form) to save registers,
without a warning and while reporting fewer spills. Such builds are 16-20% slower, so this compiles
the kernels and counts. Needs nvcc and cuobjdump, not a GPU; skipped without them.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

from k3trt.plugins import mla_cuda
from k3trt.plugins.mla_cuda import constants

_DIR = os.path.dirname(mla_cuda.__file__)


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:  # triton's wheel carries one
        import triton  # noqa: PLC0415 (optional: triton)
    except ImportError:
        return None
    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                  "cuobjdump"))
    return hits[0] if hits else None


def _kernels(src: str, tmp_path) -> dict[str, list[str]]:
    """{kernel name: its SASS instructions} of one source compiled for sm_90a."""
    obj = tmp_path / (os.path.basename(src) + ".o")
    include = constants.write_header(str(tmp_path / "include"))  # mla_constants.h, as the build
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                    "-I", _DIR, "-I", include, "-c", src, "-o", str(obj)], check=True,
                   capture_output=True)
    sass = subprocess.run([_cuobjdump(), "-sass", str(obj)], check=True, capture_output=True,
                          text=True).stdout
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m and name:
            out[name].append(m.group(1))
    return out


def serialised(ops: list[str]) -> tuple[int, int]:
    """(wgmmas, those followed within two instructions by a wait for every group)"""
    h = [i for i, op in enumerate(ops) if "HGMMA" in op or "QGMMA" in op]
    full = sum(1 for i in h if any("DEPBAR.LE gsb0, 0x0" in ops[j] for j in range(i + 1, i + 3)
                                   if j < len(ops)))
    return len(h), full


def test_serialised_counts_a_full_wait():
    ops = ["HGMMA.64x48x16.F32 R24, R120, gdesc[UR12], R24, gsb0",
           "WARPGROUP.DEPBAR.LE gsb0, 0x0",
           "HGMMA.64x48x16.F32 R48, R124, gdesc[UR12], R48, gsb0",
           "WARPGROUP.DEPBAR.LE gsb0, 0x3",
           "QGMMA.64x96x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24, gsb0",
           "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert serialised(ops) == (3, 2)


@pytest.mark.skipif(shutil.which("nvcc") is None or _cuobjdump() is None,
                    reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("src", ["swap.cu"])
def test_wgmmas_not_serialised(src, tmp_path):
    kernels = _kernels(os.path.join(_DIR, src), tmp_path)
    names = [k for k in kernels if "mla_verify_sm90" in k]
    assert len(names) == 2, names  # one CTA a request, and head groups (kGrouped)
    for name in names:
        n, full = serialised(kernels[name])
        # as landed: 16 HGMMAs (O^T) and 18 QGMMAs (S^T), 1 full wait (the end of a block's S^T); a
        # serialised build has one after nearly every wgmma
        assert n >= 34 and full <= 4, f"{name}: {full} of {n} wgmmas followed by a full wait"
        # and no spills: at setmaxnreg 144 the value loop's counted refill spills 44 B that ptxas
        # reloads every block
        local = [op for op in kernels[name] if re.match(r"(@!?U?P\w+ )?(STL|LDL)", op)]
        assert not local, f"{name}: {len(local)} local-memory accesses, e.g. {local[0]}"
