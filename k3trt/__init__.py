"""k3trt: a compiled engine builder and runtime for Kimi K3.

    from k3trt import LLM, SamplingParams
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import k3trt` (and the CLI's --help) does not pay for torch and the model code.
    if name == "LLM":
        from k3trt.runtime.llm import LLM  # noqa: PLC0415 (heavy: torch, model code)
        return LLM
    if name == "SamplingParams":
        from k3trt.runtime.params import SamplingParams  # noqa: PLC0415 (heavy: torch, model code)
        return SamplingParams
    raise AttributeError(f"module 'k3trt' has no attribute {name!r}")
