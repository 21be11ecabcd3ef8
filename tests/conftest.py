"""Shared fixtures (a tiny checkpoint, model and engine, made once per session) and the GPU rule.

GPU rule: a test that needs a CUDA GPU carries the `gpu` marker and nothing else; this file skips
it without CUDA (pytest.importorskip stays only for genuinely optional packages)."""

import logging

import pytest
import torch
from runtime_utils import build_tiny_engine

import k3trt.plugins  # noqa: F401  (registers torch.ops.k3trt.*)
import k3trt.model.vision as k3trt_vision
from k3trt.model.loader import load_model
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.runtime.tokenizer import Tokenizer, write_k3_tokenizer

# Tiny models are latency-bound: one thread is faster than two fighting over CI's 2 cores.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200; results in benchmarks/results/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny random-weight K3 checkpoint, made once per test session."""
    return make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The K3 tokenizer (write_k3_tokenizer), written once per test session; tests only read it.
    A module that needs another tokenizer defines its own `tok`."""
    d = tmp_path_factory.mktemp("k3tok")
    write_k3_tokenizer(d)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    """(cfg, model) loaded in fp32 on the CPU; tests must not modify its parameters."""
    return load_model(tiny_ckpt, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.INFO, logger="k3trt")


@pytest.fixture(scope="session")
def engine(tiny_ckpt, tmp_path_factory):
    """The runtime tests' torch engine dir over tiny_ckpt (fp32; see runtime_utils.build_tiny_engine).
    Tests must not modify it; copy it first."""
    return build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("engine") / "engine")


@pytest.fixture
def vision():
    """The vision API (k3trt.model.vision); the tiny checkpoint's model carries a MoonViT tower."""
    return k3trt_vision
