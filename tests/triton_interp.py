"""Running a test module's Triton kernels on the CPU, under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so the cases run in a fresh Python:
``run_interpreted("test_x")`` imports tests/<area>/test_x.py there and calls its ``interpreter_main()``,
which raises (an assert_close) on the first mismatch; the subprocess's stderr tail comes back in
the failure. ``run_fresh(code)`` runs code in a plain fresh Python (import-time checks).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _env(*dirs: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), *map(str, dirs), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def run_interpreted(module: str, timeout: int = 300) -> str:
    """`module`.interpreter_main() under TRITON_INTERPRET=1 (one thread); returns its stdout."""
    code = f"import torch; torch.set_num_threads(1); import {module} as t; t.interpreter_main()"
    (path,) = TESTS.glob(f"*/{module}.py")   # test basenames are unique across the area folders
    proc = subprocess.run([sys.executable, "-c", code], env=_env(path.parent, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"interpreted kernels of {module} failed:\n{proc.stderr[-6000:]}"
    return proc.stdout


def run_fresh(code: str, timeout: int = 120) -> None:
    """`code` in a fresh Python (nothing imported yet); fails with its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
