"""Compiling grammars off the step loop, once per (tokenizer, spec).

`GrammarCache.submit(spec, vocab)` returns a Future at once; a small thread pool compiles (xgrammar
releases the GIL while it builds token masks), so a request waiting for its grammar holds up no
other request. Entries are bounded (least recently used out); a failed compile is kept too, since
the same spec fails the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from k3trt.runtime.structured.grammars import build_grammar
from k3trt.runtime.structured.spec import GrammarError, GuidedSpec, reason
from k3trt.runtime.structured.state import GuidedState
from k3trt.runtime.structured.vocab import GrammarVocab, xgr

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledGuide:
    """A spec compiled for one vocabulary; immutable and shared by every request using it."""
    spec: GuidedSpec
    vocab: GrammarVocab
    grammar: Any                    # xgrammar.CompiledGrammar
    compile_s: float

    def new_state(self) -> GuidedState:
        """A fresh matcher for one request (cheap: the compiled grammar is shared)."""
        return GuidedState(self)


def compile_guide(spec: GuidedSpec, vocab: GrammarVocab,
                  compiler: Any | None = None) -> CompiledGuide:
    """Compile in the calling thread (GrammarCache runs this in its pool)."""
    start = time.perf_counter()
    compiler = compiler or xgr().GrammarCompiler(vocab.info, max_threads=1, cache_enabled=False)
    try:
        grammar = build_grammar(spec, vocab)
        compiled = compiler.compile_grammar(grammar)
    except GrammarError:
        raise
    except Exception as e:
        raise GrammarError(spec.kind, f"cannot compile the grammar: {reason(e)}") from None
    took = time.perf_counter() - start
    log.debug("compiled a %s grammar in %.3f s", spec.kind, took)
    return CompiledGuide(spec, vocab, compiled, took)


class GrammarCache:
    """Compiled grammars keyed by (tokenizer fingerprint, spec); at most `max_entries`."""

    def __init__(self, *, max_entries: int = 256, threads: int = 2) -> None:
        if max_entries < 1 or threads < 1:
            raise ValueError(f"GrammarCache: max_entries and threads must be >= 1, got "
                             f"{max_entries} and {threads}")
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="k3trt-grammar")
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, GuidedSpec], Future] = OrderedDict()
        self._compilers: dict[str, Any] = {}   # one xgrammar compiler per tokenizer
        self._threads = threads
        self.hits = self.misses = 0

    def submit(self, spec: GuidedSpec, vocab: GrammarVocab) -> "Future[CompiledGuide]":
        """The compiled grammar as a Future: `.done()` to poll from the step loop, `.result()` to
        wait; it raises GrammarError when the spec cannot be compiled."""
        key = (vocab.fingerprint, spec)
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            compiler = self._compilers.get(vocab.fingerprint)
            if compiler is None:
                compiler = xgr().GrammarCompiler(vocab.info, max_threads=self._threads,
                                                 cache_enabled=False)
                self._compilers[vocab.fingerprint] = compiler
            fut = self._pool.submit(compile_guide, spec, vocab, compiler)
            self._entries[key] = fut
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)  # holders of that future keep it alive
        return fut

    def get(self, spec: GuidedSpec, vocab: GrammarVocab,
            timeout: float | None = None) -> CompiledGuide:
        return self.submit(spec, vocab).result(timeout)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Stop the pool; queued compiles are cancelled (their futures say so)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
