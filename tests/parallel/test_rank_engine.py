"""A multi-rank engine dir end to end through the command line: `k3trt run` on a TP2 x EP2 build
(pre-sliced rank dirs, a worker process per rank: gloo on the CPU, NCCL on two GPUs) prints the
same greedy tokens as the one-rank build of the same checkpoint, spawned and under torchrun; each
worker verifies its own rank dir's checksums unless told not to. Skipped where the multi-rank runtime (k3trt.runtime.rank_session) is not installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from k3trt.builder.build import build_engine
from k3trt.cli import main
from k3trt.parallel import ParallelConfig
from k3trt.runtime.llm import LLM
from k3trt.runtime.ranks import RankFailure

pytest.importorskip("k3trt.runtime.rank_session", reason="needs the multi-rank runtime")

BUILD = dict(dtype="fp32", capacities=[1, 2], max_num_tokens=32, spec_tokens=0, block_size=16)
PROMPT = ["--prompt", "The capital of France is", "--max-tokens", "8", "--json"]


@pytest.fixture(scope="module")
def engines(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("rank_engine")
    one = build_engine(tiny_ckpt, root / "one", **BUILD)
    two = build_engine(tiny_ckpt, root / "tp2ep2", parallel=ParallelConfig(tp=2, ep=2), **BUILD)
    return one, two


def _tokens(output: str) -> list[int]:
    return json.loads(output.strip().splitlines()[-1])["token_ids"]


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h100-x2)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_run_on_two_ranks_equals_one_rank(engines, device):
    one, two = engines
    runner = CliRunner()
    ref = runner.invoke(main, ["run", str(one), *PROMPT, "--device", device])
    assert ref.exit_code == 0, ref.output
    got = runner.invoke(main, ["run", str(two), *PROMPT, "--device", device, "--tp", "2", "--rank-timeout", "60"])
    assert got.exit_code == 0, got.output
    assert _tokens(got.output) == _tokens(ref.output)


@pytest.mark.slow
def test_run_under_torchrun_equals_one_rank(engines, tmp_path):
    """Every process runs the same command; rank 0 prints, rank 1 is a worker."""
    one, two = engines
    ref = CliRunner().invoke(main, ["run", str(one), *PROMPT])
    assert ref.exit_code == 0, ref.output
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "k3trt", "run", str(two),
                          *PROMPT], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and _tokens(lines[0]) == _tokens(ref.output)


def test_workers_verify_their_own_rank_dir(engines, tmp_path):
    """Rank 0 checks only the shared files and rank0/: a rank1/ weight that no longer matches its
    checksum (but still loads) is rank 1's to refuse, and verify_checksums=False skips it there too."""
    damaged = shutil.copytree(engines[1], tmp_path / "damaged")
    shard = sorted((damaged / "rank1").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01                    # the last tensor's last byte: the file still loads
    shard.write_bytes(data)
    with pytest.raises(RankFailure, match=r"rank 1 failed: EngineDirError: .*checksum of rank1/"):
        LLM(damaged, max_model_len=64, rank_timeout_s=60)
    llm = LLM(damaged, verify_checksums=False, max_model_len=64, rank_timeout_s=60)
    try:
        assert llm.health()["ok"]
    finally:
        llm.close()
    assert [r["exitcode"] for r in llm.health()["ranks"][1:]] == [0]
