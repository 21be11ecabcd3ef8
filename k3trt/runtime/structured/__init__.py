"""Structured output: xgrammar grammars (JSON schema, JSON object, regex, EBNF, XTML tool calls),
correct under speculative decoding and reasoning.

Pieces: `GuidedSpec` (what to match; checked when made), `GrammarVocab` (one tokenizer + model
vocab size, built once per engine), `GrammarCache` (compiles off the step loop), `GuidedState`
(one request's matcher + the gate of unbounded reasoning), `apply_masks` (bitmask onto logits).

How the runtime drives it (the engine's side lives in runtime.py: `GrammarRuntime` holds the
vocabulary, the cache and the bitmask, `check_guided` refuses a request at submission;
`SamplingParams.guided` is always a GuidedSpec, made once from what the caller gave):
    vocab = GrammarVocab(tokenizer, vocab_size=model_vocab_size)      # once per engine
    cache = GrammarCache()                                            # once per engine
    bitmask = vocab.allocate_bitmask(max_rows, pin=True)              # once; rows reused per step
  submission:  spec = GuidedSpec(...)  (GrammarError -> refuse the request, naming the field)
               request.guide_future = cache.submit(spec, vocab)
  schedule:    a guided request runs only once its future is done; then (once)
               request.guided = future.result().new_state()  (GrammarError -> finish it "error")
  draft:       K drafts; model drafters draw them under the grammar (request.guided.draft_walk():
               masked argmax / masked draw, speculative/draw.py), others draft as usual
  cut:         n = request.guided.admit(drafts); drafts = drafts[:n]     (before the forward: what
               is verified must be admitted; no mask is filled here)
  run:         launch the forward (logits for every row); while it runs on the GPU:
  mask:        request.guided.fill_masks(drafts, bitmask, row0)   (returns n again; rows row0 ..
               row0 + n now hold the masks of this request's n + 1 verify rows; fill_masks_batch
               fills many requests' rows through xgrammar's BatchGrammarMatcher)
               apply_masks(logits, bitmask, indices=[rows of guided requests])   before sampling /
               acceptance (the target distribution p is the masked one)
  accept:      accepted drafts + the next token (sampled from a masked row, so it is admitted)
  commit:      k = request.guided.commit(accepted); accepted = accepted[:k];
               then eos / stop strings / max_tokens as usual (a grammar that has not finished by
               max_tokens ends with finish_reason "length": nothing here blocks or loops)
  end:         request.guided.release() wherever the request's resources are released
With no drafts (K = 0) the same calls run with drafts = [] (one row). Preemption needs nothing
(the committed tokens stay committed); `reset()` is for a request restarted from its prompt.
On CUDA, apply_masks copies the bitmask with non_blocking=True: do not refill that CPU buffer
before the step has synchronised (acceptance reads the tokens back, which does), or fill a second
buffer while a step is in flight.
"""

from k3trt.runtime.structured.cache import CompiledGuide, GrammarCache, compile_guide
from k3trt.runtime.structured.spec import (
    DEFAULT_MAX_WHITESPACE,
    DEFAULT_TOOL_REASONING_CHARS,
    GrammarError,
    GuidedSpec,
)
from k3trt.runtime.structured.state import GuidedState, fill_masks_batch
from k3trt.runtime.structured.vocab import GrammarVocab, apply_masks, pack, unpack

__all__ = ["DEFAULT_MAX_WHITESPACE", "DEFAULT_TOOL_REASONING_CHARS", "CompiledGuide", "GrammarCache",
           "GrammarError", "GrammarVocab", "GuidedSpec", "GuidedState", "apply_masks", "compile_guide", "fill_masks_batch", "pack", "unpack"]
