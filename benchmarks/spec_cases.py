"""spec_speedup.py's cases: driving an engine through a batch of prompts, timing its steps, and one
speculative case's figures (module doc of spec_speedup.py)."""

from __future__ import annotations

import time

import torch
from harness import Progress, best_s, median_ms
from oracle import OracleDrafter
from roofline import Sizes, roofline
from spec_report import speedup_at_alpha
from step_trace import trace_steps

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def drive(llm: LLM, ps: list[list[int]], max_tokens: int, *, speculate: bool = True,
          oracle: OracleDrafter | None = None) -> dict:
    """Submit every prompt, step until each has its first token, then time every step to the end."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative=speculate)
    ids = [llm.add_request(p, params) for p in ps]
    outs: dict = {}

    def step() -> None:
        for o in llm.step():
            if o.request_id in ids:
                outs[o.request_id] = o
                if o.finished and o.error:
                    raise RuntimeError(f"{o.request_id}: {o.error}")

    while not all(r in outs and outs[r].token_ids for r in ids):
        step()
    sync(llm.session.device)
    if oracle is not None:
        oracle.reset_counters()
    before = sum(len(outs[r].token_ids) for r in ids)
    ahead0 = llm.stats()["launched_ahead"]
    times = []
    while not all(outs[r].finished for r in ids):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    sync(llm.session.device)
    tokens, wall = sum(len(outs[r].token_ids) for r in ids) - before, sum(times)
    return {"launched_ahead": llm.stats()["launched_ahead"] - ahead0,
            "decode_tokens": tokens, "decode_steps": len(times), "decode_s": round(wall, 5),
            "tokens_per_s": round(tokens / wall, 2) if wall else None,
            "step_ms": round(wall * 1e3 / len(times), 4) if times else None,
            "tokens_per_step": round(tokens / len(times) / len(ids), 3) if times else None,   # per request
            "outputs": [list(outs[r].token_ids) for r in ids]}


def profile_case(llm: LLM, ps: list[list[int]], max_tokens: int, steps: int) -> dict:
    """step_trace.trace_steps over runs of the prompts as the case last ran them: where the GPU waits."""
    def start():
        prog = Progress(llm, ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative=True))
        prog.prefill()
        for _ in range(2):         # the pipeline launching ahead again
            prog.step()
        return prog.step, prog.decode
    return trace_steps(start, steps)


def step_ms(llm: LLM, batch: int, q: int) -> float | None:
    """The (capacity of `batch`, q) step alone, as it was last run: a graph replay timed by CUDA
    events, or on the CPU the static step host-timed. None: the engine has no such step."""
    s = llm.session
    cap = next((c for c in sorted(getattr(s, "capacities", ())) if c >= batch), None)
    st = getattr(s, "steps", {}).get((cap, q))
    if st is None:
        return None
    if st.graph is not None:
        return round(median_ms(st.graph.replay, warmup=2, reps=15), 4)
    with torch.inference_mode():
        return round(best_s(lambda: s._run_static(st), reps=3) * 1e3, 4)


def roofline_ms(a, ceil: dict, model, batch: int, q: int) -> float:
    """The step's roofline (roofline.py) at the run's mean decode context, with its ceilings."""
    r = roofline(Sizes.of(model, next(model.parameters()).dtype), seqs=batch, q=q,
                 ctx=a.prompt_len + a.max_tokens / 2, copy_gbps=ceil["copy_gbps"], gemm_tflops=ceil["gemm_tflops"],
                 save_states=q > 1)
    return r["roofline_ms"]


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verify step when each draft is accepted with probability α given the earlier ones."""
    return float(sum(alpha ** i for i in range(k + 1)))


def run_until_held(llm: LLM, oracle: OracleDrafter, ps: list, max_tokens: int, reruns: int) -> tuple[dict, int]:
    """Runs of the prompts until one ends with every request on its reference (at most reruns + 1);
    after a run where some left theirs (a verify step's argmax other than plain decoding's, within
    bf16 rounding), those requests take its outputs as their references. The last run and its index."""
    for rerun in range(reruns + 1):
        r = drive(llm, ps, max_tokens, oracle=oracle)
        if not oracle.diverged or rerun == reruns:
            break
        for p, out in zip(ps, r["outputs"]):
            if tuple(p) in oracle.diverged:
                oracle.set_references([p], [out])
        oracle.configure(alpha=oracle.alpha, seed=oracle.seed, cost=oracle.cost)
    return r, rerun


def converge(llm: LLM, oracle: OracleDrafter, ps: list, max_tokens: int, runs: int, seed: int) -> int:
    """The references brought to this engine's verify numerics before a batch's cases (at α 1, free
    drafts), so no case (the first, say) pays for it. Requests still off their reference after it."""
    oracle.configure(alpha=1.0, seed=seed, cost=None)
    if runs > 0:
        run_until_held(llm, oracle, ps, max_tokens, runs - 1)
    off = len(oracle.diverged)
    oracle.configure(alpha=1.0, seed=seed, cost=None)
    return off


def measure_case(llm: LLM, oracle: OracleDrafter, ps: list, base: dict, k: int, alpha: float, max_tokens: int,
                 reruns: int) -> dict:
    """One case: its figures come from the last of run_until_held's runs (``run``, 1-based);
    ``held`` False where requests left their reference in it (``diverged``): they got no drafts
    from there on, so its figures are not at α."""
    r, rerun = run_until_held(llm, oracle, ps, max_tokens, reruns)
    outs = r.pop("outputs")
    r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if r["tokens_per_s"] else None
    r["exact"] = outs == base["outputs"]
    r["differ_from_plain"] = sum(o != b for o, b in zip(outs, base["outputs"]))     # requests
    r["reruns"], r["run"] = rerun, rerun + 1
    r["diverged"] = len(oracle.diverged)
    r["held"] = not oracle.diverged
    r["alpha_measured"] = round(oracle.alpha_measured, 4) if oracle.alpha_measured is not None else None
    r["drafted_tokens"] = oracle.drafted
    draft_s = oracle.draft_s
    r["draft_ms_per_token"] = round(draft_s * 1e3 / oracle.drafted, 4) if oracle.drafted else None
    r["draft_ms_per_step"] = round(draft_s * 1e3 / r["decode_steps"], 4) if r["decode_steps"] else None
    r["ahead_share"] = round(r["launched_ahead"] / r["decode_steps"], 3) if r["decode_steps"] else None
    r["expected_tokens_per_step"] = round(expected_tokens(alpha, k), 3)
    r["speedup_at_alpha"] = speedup_at_alpha(r["expected_tokens_per_step"], base.get("step_ms"), r["step_ms"])
    return r


def finish_row(row: dict, verify_ms: float | None, decode_ms: float | None, host_sync: float | None) -> None:
    row["verify_ms"], row["decode_ms"] = verify_ms, decode_ms
    row["verify_vs_decode"] = round(verify_ms / decode_ms, 3) if verify_ms and decode_ms else None
    row["host_exposed_ms"] = minus(minus(row["step_ms"], row["draft_ms_per_step"]), verify_ms)
    row["host_hidden_ms"] = hidden_ms(host_sync, row["host_exposed_ms"])
    if row["verify_vs_decode"]:
        row["ideal_speedup"] = round(row["expected_tokens_per_step"] / row["verify_vs_decode"], 3)
        row["of_ideal"] = round(row["speedup"] / row["ideal_speedup"], 3) if row.get("speedup") else None


def ratio(x, y):
    return round(x / y, 3) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def minus(x, y):
    return round(x - y, 4) if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None


def hidden_ms(host_sync, exposed):
    return round(max(0.0, host_sync - exposed), 4) if host_sync is not None and exposed is not None else None
