"""benchmarks/e2e.py in its CPU smoke mode (tiny preset, --quick): every case runs and lands in the
JSON with its roofline, the goals are evaluated, and plot_e2e.py draws the result. The roofline's
byte / flop model is checked on its own against hand counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e  # noqa: E402


def test_roofline_counts():
    sz = e2e.Sizes(dense_params=100, dense_bytes=200, embed_row_bytes=8, expert_params=10, expert_bytes=20,
                   moe_layers=2, num_experts=4, top_k=2, mla_layers=1, kda_layers=1, heads=2, mla_row_bytes=6,
                   mla_score_dim=3, kv_lora=2, qk_head_dim=4, v_head_dim=2, kda_heads=1, kda_dim=2,
                   kda_state_bytes=16)
    r = e2e.roofline(sz, seqs=1, q=1, ctx=9, copy_gbps=1.0, gemm_tflops=1e-3)
    assert r["experts_per_moe_layer"] == 2                               # batch 1: exactly top-k
    assert r["weight_bytes"] == 200 + 8 + 2 * 2 * 20
    assert r["cache_bytes"] == (9 + 1) * 6 + 6 + 2 * 16                   # MLA rows read + written, KDA r+w
    assert r["flops"] == 2 * (100 + 2 * 2 * 10) + 2 * 2 * 10 * (3 + 2) + 8 * 1 * 4
    assert r["roofline_ms"] == max(r["bytes_ms"], r["flops_ms"])
    many = e2e.roofline(sz, seqs=64, q=1, ctx=9, copy_gbps=1.0, gemm_tflops=1e-3)
    assert many["experts_per_moe_layer"] == pytest.approx(4)             # every expert touched


def test_smoke_run(tmp_path):
    out = tmp_path / "e2e.json"
    doc = e2e.main(["--preset", "tiny", "--device", "cpu", "--quick", "--vocab", "1024", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["cases"] == doc["cases"] and not doc["errors"]
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
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(Path(e2e.__file__).parent))
    import plot_e2e
    png = plot_e2e.main([str(out)])
    assert png.stat().st_size > 10_000
