"""benchmarks/record.py: the command a benchmark's JSON records parses back into the same argv."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from record import command  # noqa: E402


def test_command_round_trips_its_arguments():
    argv = ["--extra", "12:256:8192;12:1:131072", "--json", "out dir/x.json", "--a", "n=_exp/x:share"]
    line = command("/any/where/benchmarks/mla_verify.py", argv)
    assert line.startswith("PYTHONPATH=. python benchmarks/mla_verify.py ")
    assert shlex.split(line)[3:] == argv


def test_command_defaults_to_this_process_arguments(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/e2e.py", "--quick"])
    assert command("e2e.py") == "PYTHONPATH=. python benchmarks/e2e.py --quick"
