"""The benchmark scripts run as a user runs them, in a subprocess from the repository root:
benchmarks/e2e.py in its CPU smoke mode (tiny preset, --quick) runs every case, lands each in the
JSON with its roofline, evaluates the goals, and records a command that parses back into the
arguments it was given; benchmarks/roofline.py's byte / flop model matches hand counts."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str, timeout: int = 600) -> str:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


SIZES = dict(dense_params=100, dense_bytes=200, embed_row_bytes=8, expert_params=10, expert_bytes=20,
             moe_layers=2, num_experts=4, top_k=2, mla_layers=1, kda_layers=1, heads=2, mla_row_bytes=6,
             mla_score_dim=3, kv_lora=2, qk_head_dim=4, v_head_dim=2, kda_heads=1, kda_dim=2,
             kda_state_bytes=16)


def roofline(seqs: int) -> dict:
    out = run_script("benchmarks/roofline.py", "--sizes", json.dumps(SIZES), "--seqs", str(seqs), "--q", "1",
                     "--ctx", "9", "--copy-gbps", "1", "--gemm-tflops", "1e-3")
    return json.loads(out)


def test_roofline_counts():
    r = roofline(1)
    assert r["experts_per_moe_layer"] == 2                               # batch 1: exactly top-k
    assert r["weight_bytes"] == 200 + 8 + 2 * 2 * 20
    assert r["cache_bytes"] == (9 + 1) * 6 + 6 + 2 * 16                   # MLA rows read + written, KDA r+w
    assert r["flops"] == 2 * (100 + 2 * 2 * 10) + 2 * 2 * 10 * (3 + 2) + 8 * 1 * 4
    assert r["roofline_ms"] == max(r["bytes_ms"], r["flops_ms"])
    assert roofline(64)["experts_per_moe_layer"] == pytest.approx(4)     # every expert touched


def test_smoke_run(tmp_path):
    out = tmp_path / "out dir" / "e2e.json"                               # a space: the command quotes it
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--vocab", "1024", "--json", str(out)]
    printed = run_script("benchmarks/e2e.py", *argv)
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("PYTHONPATH=. python benchmarks/e2e.py ")
    assert shlex.split(doc["command"])[3:] == argv
    assert not doc["errors"] and "decode b1" in printed
    names = {c["name"]: c for c in doc["cases"]}
    assert {"decode b1", "decode b4", "prefill", "layerskip:1 K3 b1", "eager b1", "eager-ref b1"} <= set(names)
    assert "mla_verify" in names["eager-ref b1"]["plugins_off"]
    for c in doc["cases"]:
        assert "error" not in c, (c["name"], c.get("traceback"))
        if c["kind"] != "hf":
            assert c["tokens_per_s"] > 0 and c["ratio"] > 0 and c["roofline"]["roofline_ms"] > 0
    assert names["layerskip:1 K3 b1"]["mean_accepted_length"] >= 1
    assert set(doc["goals"]) == {"decode_b1_within_1.3x_roofline", "decode_b32_within_1.3x_roofline",
                                 "graphs_vs_eager_b1_5x", "graphs_vs_eager_noplugins_b1_5x", "self_draft_b1_2.5x"}
    assert doc["machine"]["ceilings"]["copy_gbps"] > 0 and doc["model"]["sizes"]["moe_layers"] == 3
