"""The engine's side of structured output: one `GrammarVocab` (built on first use, off the step loop),
one `GrammarCache` (the one compile path: GuidedSpec -> CompiledGuide, cached), the bitmask rows
of a step, and the submission check of a guided request.

    grammars = GrammarRuntime(tokenizer, vocab_size, rows=max_batch * (K + 1))   # per engine, cheap
    req.guide_future = grammars.submit(params.guided)   # at add_request: never blocks
                                                # (thread-safe: the server compiles ahead with it)
    grammars.attach_ready(waiting, fault)       # each step: compiled ones get their matcher
    grammars.cut_drafts(reqs, fault)            # after the schedule, before the forward: drafts cut at
                                                #   the first token the grammar refuses (then refit)
    out = run_plan(...)                         # the forward, launched (asynchronous on CUDA)
    rows = grammars.fill(out.rows, fault)       # meanwhile on the host: K+1 mask rows per request
    grammars.apply(out.logits, rows)            # before sampling / acceptance

The mask fill runs after the forward is launched so that its host time hides under the GPU's; only
the draft check, which can change what the forward verifies, runs before. A grammar fault in
`fill` ends its request (fault): its rows were computed and are ignored (the loop skips finished
requests). Fills of many requests go through xgrammar's BatchGrammarMatcher (C++ threads) from
`batch_min` guided requests on; fewer are filled one by one (GuidedState.fill_masks).

`check_guided` runs at submission (request.new_request): a guided request needs the engine's
tokenizer, and `after_reasoning` must match the prompt (thinking on: the prompt leaves a `think` block open; xtml.reasoning_open).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from k3trt.runtime.params import RequestError
from k3trt.runtime.structured.cache import CompiledGuide, GrammarCache
from k3trt.runtime.structured.spec import GuidedSpec
from k3trt.runtime.structured.state import fill_masks_batch
from k3trt.runtime.structured.vocab import GrammarVocab, apply_masks, num_words, xgr
from k3trt.runtime.xtml import OPEN, reasoning_open

log = logging.getLogger(__name__)


def check_guided(spec: GuidedSpec, prompt_ids: Sequence[int], tokenizer: Any) -> None:
    """Refuse (RequestError naming the field) a guided request this engine cannot run as asked."""
    if tokenizer is None:
        raise RequestError("guided", "structured output needs the engine's tokenizer (the engine dir has none)")
    if OPEN not in getattr(tokenizer, "special_ids", {}):
        return                               # not a K3 tokenizer: no think channel to match
    thinking = reasoning_open(tokenizer.decode(prompt_ids))
    if spec.after_reasoning != thinking:
        where = "leaves a think block open (thinking on)" if thinking else "does not leave a think block open"
        raise RequestError("guided.after_reasoning", f"is {spec.after_reasoning} but the prompt {where}; "
                                                     f"set after_reasoning={thinking}")


class GrammarRuntime:
    """Per engine: the vocabulary, the compile cache and the step's bitmask (module doc)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, rows: int, threads: int = 2,
                 fill_threads: int | str = "auto", batch_min: int = 8):
        self._tokenizer, self._vocab_size, self.rows = tokenizer, vocab_size, rows
        self.fill_threads, self.batch_min = fill_threads, batch_min    # batched mask fill (module doc)
        self._batcher = None
        self._lock = threading.Lock()
        self._vocab: Future[GrammarVocab] | None = None
        self._builder: ThreadPoolExecutor | None = None
        self.cache = GrammarCache(threads=threads)
        self._bitmask: torch.Tensor | None = None

    # ---- per step ----------------------------------------------------------------------------------
    def attach_ready(self, reqs: Sequence[Any], fault: Callable[[Any, str], None]) -> None:
        """Requests whose grammar finished compiling get their matcher (req.guided); a grammar that
        failed to compile ends its request (fault)."""
        for req in reqs:
            if req.guide_future is not None and req.guide_future.done():
                try:
                    req.guided = req.guide_future.result().new_state()
                    req.guide_future = None
                except Exception as e:
                    fault(req, f"grammar failed to compile: {e}")

    def cut_drafts(self, reqs: Sequence[Any], fault: Callable[[Any, str], None]) -> None:
        """Before the forward: cut each guided request's drafts at the first token its grammar
        refuses (GuidedState.admit; no mask is filled). A grammar fault ends its request; call
        Scheduler.refit after this (a fault or a cut changes the step)."""
        for req in reqs:
            if req.guided is not None and req.drafts:
                try:
                    n = req.guided.admit(req.drafts)
                except Exception as e:
                    fault(req, f"grammar failed: {type(e).__name__}: {e}")
                    continue
                if n < len(req.drafts):
                    req.set_drafts(req.drafts[:n], req.draft_q)

    def fill(self, rows: Sequence[Any], fault: Callable[[Any, str], None]) -> list[int]:
        """After the forward is launched: the bitmask rows of the step's logits layout `rows`
        (step.Rows: req, row0, num = 1 + its drafts, already cut by cut_drafts). Returns the guided
        rows. A grammar fault ends its request (fault): its rows are left out, and the loop ignores
        the rows of a finished request."""
        items = []
        for r in rows:
            req = r.req
            if req.guided is not None and not req.finished:
                items.append((req, req.drafts[:r.num - 1], r.row0))
        if not items:
            return []
        bm = self.bitmask
        if len(items) >= self.batch_min:
            errors = fill_masks_batch([(req.guided, d, row0) for req, d, row0 in items], bm, self._batch())
        else:
            errors = []
            for req, drafts, row0 in items:
                try:
                    n = req.guided.fill_masks(drafts, bm, row0)
                    errors.append(None if n == len(drafts) else RuntimeError(
                        f"the grammar refused draft {n} after admitting it before the step"))
                except Exception as e:
                    errors.append(e)
        out = []
        for (req, drafts, row0), e in zip(items, errors):
            if e is not None:
                fault(req, f"grammar failed: {type(e).__name__}: {e}")
            else:
                out.extend(range(row0, row0 + 1 + len(drafts)))
        return out

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask the guided rows of the step's logits in place (before processors, penalties,
        sampling and acceptance, so nothing can revive a token the grammar refuses)."""
        if rows:
            with torch.inference_mode():     # the session's logits are inference tensors
                apply_masks(logits, self.bitmask[:logits.shape[0]], indices=rows)

    # ---- internals ----------------------------------------------------------------------------------
    def _batch(self) -> Any:
        if self._batcher is None:
            self._batcher = xgr().BatchGrammarMatcher(self.fill_threads)
        return self._batcher

    def _vocab_future(self) -> "Future[GrammarVocab]":
        with self._lock:
            if self._vocab is None:
                self._builder = ThreadPoolExecutor(1, thread_name_prefix="k3trt-grammar-vocab")
                self._vocab = self._builder.submit(GrammarVocab, self._tokenizer, vocab_size=self._vocab_size)
            return self._vocab

    def submit(self, spec: GuidedSpec) -> "Future[CompiledGuide]":
        """The compiled guide as a Future; it raises GrammarError when xgrammar refuses the spec.
        Thread-safe (the vocabulary build and the cache are locked): the server calls it from its
        event loop to refuse a bad grammar before admission, and the step loop's submission of the
        same spec then finds it in the cache."""
        out: Future[CompiledGuide] = Future()

        def relay(inner: Future) -> None:
            e = inner.exception()
            out.set_exception(e) if e is not None else out.set_result(inner.result())

        def on_vocab(vf: Future) -> None:
            e = vf.exception()
            if e is not None:
                out.set_exception(e)
                return
            try:
                self.cache.submit(spec, vf.result()).add_done_callback(relay)
            except BaseException as e:    # the pool is shut down
                out.set_exception(e)

        self._vocab_future().add_done_callback(on_vocab)
        return out

    @property
    def bitmask(self) -> torch.Tensor:
        """int32 [rows, words] on the CPU; filled by GuidedState.fill_masks each step."""
        if self._bitmask is None:
            bm = torch.full((self.rows, num_words(self._vocab_size)), -1, dtype=torch.int32)
            self._bitmask = bm.pin_memory() if torch.cuda.is_available() else bm
        return self._bitmask

    def close(self) -> None:
        self.cache.close()
        if self._builder is not None:
            self._builder.shutdown(wait=False, cancel_futures=True)
