"""Tensor, expert and decode-context parallelism for Kimi K3.

  config.py     ParallelConfig(tp, dcp, ep, dcp_interleave, rank): groups, checks against the model
  comm.py       Comm (single process, no-op) and TorchComm (torch.distributed: NCCL / gloo)
  shard.py      the weight-sharding table, applied by k3trt.model.weights.load_weights
  attention.py  absorbed MLA over a DCP-sharded cache, partials merged by LSE
  cache.py      a rank's caches: local KDA heads, DCP slot mapping
  check.py      the greedy equivalence schedule (tests and multi-GPU runs share it)
  launch.py     process launcher (spawn or torchrun), multicast switches off, the check as a CLI

The model takes a ``comm`` (default: single process, byte-for-byte the old behaviour):
``load_model(ckpt, comm=TorchComm(ParallelConfig(tp=8, dcp=8, ep=8, rank=r)))``.

Run here (CPU, gloo, tests/parallel/test_parallel.py; fp32): greedy tokens equal to one process and logits
within 5e-5 for TP 2, DCP 2 (interleave 1, 4), DCP 4, EP 2, TP2 × DCP2 × EP2, TP2 × DCP4 × EP2,
TP4 × DCP4 × EP4 and TP4 × DCP2 × EP4 on the tiny preset with 4 KDA heads, over chunked prefill,
decode, verification with KDA rollback, and the MTP layer; the sharded loader on the tiny
preset's own checkpoints (bf16 and mxfp4). launch.py ran on CPU (spawn and torchrun, gloo).
`k3trt build --tp/--dcp/--ep` writes one pre-sliced rank{r}/ per rank (builder/split.py,
model/rank_checkpoint.py), loaded equal to the loader's own cut (bf16, fp8, mxfp4;
tests/engine/test_rank_dirs.py); the CLI, /health's 503 and the Triton repository of a multi-rank
engine ran on CPU too.

Not run here, for the multi-GPU machine (nvidia-h200-x2/-x4/-x8; launch.py forces
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1):
1. correctness on NCCL against one GPU on the same checkpoint (greedy tokens equal, logits close;
   fp32 is the equivalence check, then --dtype bf16 to run the Triton kernels):
     python -m k3trt.parallel.launch CKPT --tp {2,4,8}
     python -m k3trt.parallel.launch CKPT --dcp {2,4,8} [--interleave 1|16|64]
     python -m k3trt.parallel.launch CKPT --ep {2,4,8}
     python -m k3trt.parallel.launch CKPT --tp 8 --dcp 8 --ep 8
   with CKPT a medium-preset checkpoint (96 MLA / KDA heads, 32 experts: every size divides).
   Not run on any GPU yet: NCCL collectives through TorchComm, the Triton mla_verify kernel with
   dcp_size > 1, and with long q_per_req (DCP prefill chunks go through it, one call per
   sequence), merge_attn_states' Triton kernel inside the DCP merge.
2. the engine end to end over NCCL; no more code, only the commands (README "Multi-GPU"):
     k3trt make-checkpoint --preset medium --output CKPT --device cuda
     k3trt build CKPT --output ENG --backend torch --tp 8 --dcp 8 --ep 8
     k3trt run ENG --prompt Hello --device cuda --max-tokens 32 --json    (the same tokens as a
         --tp 1 build of CKPT with --dtype fp32 on both)
     k3trt serve ENG --device cuda        k3trt triton-serve ENG --device cuda
     torchrun --nnodes 2 --nproc-per-node 8 ... -m k3trt serve ENG16 --device cuda  (two nodes,
         ENG16 built with --tp 16 --dcp 16 --ep 16)
3. an end-to-end benchmark (benchmarks/e2e.py over a multi-rank engine) at TP8 + DCP8 (+ EP8) on the medium preset with
   more layers, the per-step roofline counting collective bytes: per MLA layer q all-gather
   (D-1)·T·H_l·576·b and partial
   (out, lse) all-gather (D-1)·T·H_g·(512·b+4) (attention.py), per layer one TP all-reduce of
   [T, hidden] after o_proj and after the MLP / shared experts, per MoE layer one EP all-reduce
   of [T, latent], and the logits all-gather [rows, V]. The runtime owns one shard per rank
   (k3trt/runtime/ranks.py, rank_session.py: rank 0's plans broadcast, per-rank KDA heads and DCP
   slot mapping; on CPU/gloo in tests/parallel/test_ranks.py). Not run on GPUs yet, one command
   on nvidia-h100-x2: python -m pytest -q -m gpu tests/parallel/test_ranks_gpu.py
   tests/parallel/test_rank_engine.py (NCCL steps against one GPU, CUDA graphs captured with the
   NCCL collectives inside, a killed rank and one hanging during a graph replay, `k3trt run`).
4. Measure the cheaper DCP merge (lse all-gather + reduce-scatter of rescaled outs) against the
   all-gather + merge_attn_states used now. TensorRT engines have no collectives yet: TP engines
   would need a k3trt all-reduce plugin over NCCL (as TensorRT-LLM has); only the torch backend
   runs parallel.
"""

from k3trt.parallel.comm import SINGLE, Comm, TorchComm
from k3trt.parallel.config import ParallelConfig, ParallelConfigError

__all__ = ["SINGLE", "Comm", "TorchComm", "ParallelConfig", "ParallelConfigError"]
