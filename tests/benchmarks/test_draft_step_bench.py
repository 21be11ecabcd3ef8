"""benchmarks/draft_step.py in its CPU smoke mode: every mode and batch lands in the JSON with its
roofline, the graphs modes run the static steps and the reduced head scores only its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_draft_step_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "draft_step.json"
    proc = subprocess.run([sys.executable, "benchmarks/draft_step.py", "--preset", "tiny", "--device", "cpu",
                           "--quick", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    cases = {(c["mode"], c["batch"]): c for c in doc["cases"]}
    assert set(cases) == {(m, b) for m in ("eager", "graphs", "graphs, vocab 1000") for b in (1, 4)}
    assert all(c["ms"] > 0 and c["roofline_ms"] > 0 for c in cases.values())
    assert cases["graphs", 1]["steps"]["static_steps"] > 0 and "static_steps" not in cases["eager", 1]["steps"]
    assert cases["graphs, vocab 1000", 4]["head_rows"] == 1000
    assert cases["graphs, vocab 1000", 4]["roofline_ms"] < cases["graphs", 4]["roofline_ms"]
    assert "roofline/ms" in proc.stdout and doc["command"].startswith("PYTHONPATH=. python benchmarks/draft_step.py")
