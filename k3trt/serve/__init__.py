"""The OpenAI-compatible HTTP server (`k3trt serve`). Needs the `serve` extra (starlette, uvicorn,
pydantic); nothing here is imported by the rest of k3trt."""

from k3trt.serve.server import ServeConfig, ServerThread, build_app, serve_main

__all__ = ["ServeConfig", "ServerThread", "build_app", "serve_main"]
