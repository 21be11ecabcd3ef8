"""k3trt: a compiled engine builder and runtime for Kimi K3."""

__version__ = "0.1.0"
