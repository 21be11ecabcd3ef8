"""Triton Inference Server: a model repository that serves a k3trt engine dir from Triton's
Python backend (repository.py writes it; engine_model.py / unary_model.py run in it; launch.py
starts the `tritonserver` of the nvidia-pytriton wheel; serve.py is `k3trt triton-serve`). Writing a repository needs
nothing beyond k3trt; serving needs the `serve` extra inside Triton's Python environment."""

from k3trt.triton.repository import triton_repo_main, write_model_repository

__all__ = ["triton_repo_main", "write_model_repository"]
