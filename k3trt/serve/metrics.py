"""/metrics in Prometheus' text exposition format (0.0.4), written by hand: a dozen gauges and
counters do not need a client library.

Sources: a snapshot taken on the engine thread (`EngineLoop.stats()`: scheduler queues, cache use,
step and token counters, finished requests by reason, and the engine's live speculative counters,
`LLM.stats()["speculative"]`, which count every verify step as it runs, aborted and preempted
requests included) and the server's own admission counters.
"""

from __future__ import annotations

from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _fmt(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def render(s: dict[str, Any], engine: Any) -> str:
    cache, totals, finished, spec = s["cache"], s["totals"], s["finished"], s["speculative"]
    rows: list[tuple[str, str, str, Any]] = [
        ("k3trt_requests_waiting", "gauge", "Requests queued in the scheduler (new or preempted)", s["waiting"]),
        ("k3trt_requests_running", "gauge", "Requests holding cache blocks and a KDA slot", s["running"]),
        ("k3trt_requests_admitted", "gauge", "Choices admitted by the server and not yet finished", engine.pending),
        ("k3trt_requests_admit_limit", "gauge", "Most choices the server admits before answering 429",
         engine.max_pending),
        ("k3trt_requests_rejected_total", "counter", "Requests refused with 429", engine.rejected),
        ("k3trt_requests_finished_total", "counter", "Engine requests finished, by reason",
         {("reason", k): v for k, v in sorted(finished.items())}),
        ("k3trt_prompt_tokens_total", "counter", "Prompt tokens submitted", totals.get("prompt_tokens", 0)),
        ("k3trt_generation_tokens_total", "counter", "Tokens generated", s["generated_tokens"]),
        ("k3trt_generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s",
         s["tokens_per_s"]),
        ("k3trt_engine_steps_total", "counter", "Engine steps run", s["steps"]),
        ("k3trt_preemptions_total", "counter", "Requests preempted for cache blocks", s["preemptions"]),
        ("k3trt_spec_tokens", "gauge", "Draft tokens per request and step, by drafting method (0: no speculation)",
         {("method", spec["method"]): spec["spec_tokens"]}),
        ("k3trt_spec_verify_steps_total", "counter", "Request verify steps that carried drafts",
         spec["verify_steps"]),
        ("k3trt_spec_draft_tokens_total", "counter", "Draft tokens proposed and verified", spec["drafted_tokens"]),
        ("k3trt_spec_accepted_tokens_total", "counter", "Draft tokens accepted", spec["accepted_tokens"]),
        ("k3trt_spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens (0 before any draft)",
         spec["acceptance_rate"] or 0.0),
        ("k3trt_spec_mean_accepted_length", "gauge",
         "Tokens emitted per verify step that carried drafts: accepted drafts + 1 (0 before any draft)",
         spec["mean_accepted_length"] or 0.0),
        ("k3trt_spec_accepted_drafts_total", "counter", "Verify steps that carried drafts, by drafts accepted",
         {("accepted", n): c for n, c in sorted(spec["accepted_length_histogram"].items())}),
        ("k3trt_kv_cache_blocks_in_use", "gauge", "MLA cache blocks referenced by live requests",
         cache["blocks_in_use"]),
        ("k3trt_kv_cache_blocks_total", "gauge", "MLA cache blocks in the pool", s["num_blocks"]),
        ("k3trt_kv_cache_usage_ratio", "gauge", "Share of MLA cache blocks in use",
         cache["blocks_in_use"] / s["num_blocks"] if s["num_blocks"] else 0.0),
        ("k3trt_kda_slots_in_use", "gauge", "KDA state slots held by live requests", cache["slots_in_use"]),
        ("k3trt_kda_slots_total", "gauge", "KDA state slots for live requests", s["max_batch"]),
        ("k3trt_time_to_first_token_seconds", "summary", "Time to first token of finished requests",
         {("_sum",): totals.get("ttft_s", 0.0), ("_count",): totals.get("ttft_n", 0)}),
    ]
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        if kind == "summary":
            lines += [f"{name}{suffix} {_fmt(x)}" for (suffix,), x in value.items()]
        elif isinstance(value, dict):
            lines += [f'{name}{{{k}="{v}"}} {_fmt(x)}' for (k, v), x in value.items()]
        else:
            lines.append(f"{name} {_fmt(value)}")
    return "\n".join(lines) + "\n"
