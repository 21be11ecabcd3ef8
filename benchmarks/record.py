"""The command line a benchmark's JSON records, in one form for every script: what to paste into a
shell at the repo root to make that JSON again."""

from __future__ import annotations

import os
import shlex
import sys


def command(script: str, argv: list[str] | None = None) -> str:
    """`PYTHONPATH=. python benchmarks/<script> <args>`; script: the caller's __file__ (or its name),
    argv: what its main() parsed (None: this process's own arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["PYTHONPATH=. python", f"benchmarks/{os.path.basename(script)}",
                     *map(shlex.quote, args)])
