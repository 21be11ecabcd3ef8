"""benchmarks/vision_encode.py as a user runs it, in its CPU smoke mode (tiny tower): every batch
lands in the JSON with its roofline and the command that makes it again; the FLOP count matches
a hand count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from test_e2e_bench import ROOT, run_script

sys.path.insert(0, str(ROOT / "benchmarks"))

from vision_encode import TINY, TINY_BATCHES, flops  # noqa: E402


def test_smoke_run_writes_every_batch(tmp_path: Path):
    out = tmp_path / "vision.json"
    stdout = run_script("benchmarks/vision_encode.py", "--device", "cpu", "--tiny", "--reps", "1", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["command"].endswith(f"--device cpu --tiny --reps 1 --json {out}")
    assert [r["batch"] for r in doc["rows"]] == [name for name, _ in TINY_BATCHES]
    assert all(r["encode_ms"] > 0 and r["roofline_ms"] > 0 and "error" not in r for r in doc["rows"])
    assert "vision encode (tiny" in stdout and "ratio" in stdout


def test_flop_count():
    # one 2×2 image: 4 patches, 1 token
    h, i, p, L = TINY.hidden_size, TINY.intermediate_size, TINY.patch_size, TINY.num_hidden_layers
    dense = 2 * 4 * 3 * p * p * h + L * 2 * 4 * (4 * h * h + 2 * h * i)
    attn = L * 4 * 4 * 4 * h
    proj = 2 * (4 * h * 4 * h + 4 * h * TINY.text_hidden_size)
    assert flops(TINY, [(1, 2, 2)]) == dense + attn + proj
