"""The Python API end to end: a tiny random-weight checkpoint, a torch engine dir, batch generation,
streaming, and one chat prompt. Runs on a CPU in a few seconds (the text is random: the weights are).

    python examples/generate.py [--workdir DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from k3trt.builder.build import build_engine
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.runtime.chat import render_ids
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="where to put the checkpoint and engine")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="k3trt-example-"))

    ckpt = work / "tiny-ckpt"
    if not ckpt.exists():
        make_checkpoint("tiny", ckpt, seed=0)
    engine = work / "tiny-engine"
    if not engine.exists():
        # fp32 on the CPU (bf16 matmuls are slow there); verify batch capacities 1, 2, 4, 8
        build_engine(ckpt, engine, dtype="fp32", capacities=[1, 2, 4, 8], max_num_tokens=256,
                     spec_tokens=0, block_size=16)

    llm = LLM(engine, device=args.device)

    # batch generation: one SamplingParams for all, or one per prompt
    outs = llm.generate(["The capital of France is", "def fibonacci(n):"],
                        [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8, seed=1)])
    for out in outs:
        print(f"[{out.index}] {out.finish_reason:6s} {out.stats['tokens_per_s']:.1f} tok/s  {out.text!r}")

    # streaming: deltas as they come; closing the iterator early cancels the request
    print("stream: ", end="")
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=16, stop=["\n\n"])):
        print(delta.delta_text, end="", flush=True)
    print()

    # chat: render the K3 template to ids (untrusted text stays text), then generate from the ids
    ids = render_ids(llm.tokenizer, [{"role": "user", "content": "Say hello."}])
    print("chat:", llm.generate([ids], SamplingParams(max_tokens=8))[0].text)
    print("engine stats:", llm.stats())


if __name__ == "__main__":
    main()
