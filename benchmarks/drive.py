"""Driving requests through ``LLM.step`` for the benchmarks: submit them together, step until each
has its first token (prefill), then time every decode step until all have finished.

    prog = Progress(llm, prompts, params)
    prog.prefill()
    before = prog.tokens
    times = prog.decode()          # seconds per step
"""

from __future__ import annotations

import time


class Progress:
    def __init__(self, llm, prompts, params):
        self.llm = llm
        self.n_out = dict.fromkeys([llm.add_request(p, params) for p in prompts], 0)
        self.done: set[str] = set()

    @property
    def tokens(self) -> int:
        """Output tokens of these requests so far."""
        return sum(self.n_out.values())

    def step(self) -> None:
        """One engine step; a request of ours that ended in an error fails the benchmark."""
        for o in self.llm.step():
            if o.request_id in self.n_out:
                self.n_out[o.request_id] = len(o.token_ids)
                if o.finished:
                    self.done.add(o.request_id)
                    if o.error:
                        raise RuntimeError(f"{o.request_id}: {o.error}")

    def prefill(self) -> None:
        while not all(self.n_out.values()):
            self.step()

    def decode(self) -> list[float]:
        times = []
        while len(self.done) < len(self.n_out):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times
