"""TensorRT side of ``k3trt::mla_verify`` (the op: mla_verify.py; its ONNX node: mla_verify.ONNX;
builder/tensorrt.py imports ``k3trt.plugins.<op>_trt`` for each plugin node of a graph): a quickly
deployable plugin (``tensorrt.plugin``, TensorRT >= 10.8) whose ahead-of-time implementation hands
TensorRT the Triton kernel's PTX, so a built engine runs the kernel without Python.

NOT RUN HERE. ``tensorrt`` cannot be installed in this workplace (shared/ENVIRONMENT.md) and no
TensorRT engine can run on its GPU; this module is written to the documented ``tensorrt.plugin``
API and checked only as far as this machine allows: the PTX it would hand over is compiled for
SM90 and re-assembled with ptxas after the parameter rewrite below (tests/plugins/test_mla_verify.py,
when triton is importable). ``tensorrt`` and ``triton`` are imported inside functions only.

Plugin "k3trt::mla_verify" (what the ONNX node of the same name maps to):
  inputs      q [T, H, D] bf16|fp16, kv_cache [blocks, page, D] (q's type or fp8),
              block_table [B, max_blocks] int32, seq_lens [B] int32
  attributes  q_per_req, softmax_scale, kv_scale, d_v, dcp_size, dcp_rank, dcp_interleave,
              sparse_chunk, sparse_sink, sparse_stride, sparse_recent (the op's arguments)
  outputs     out [T, H, d_v] in q's type, lse [T, H] fp32; every tensor LINEAR.
H, D and page must be build-time constants (one engine per capacity; only B and the table width
may vary). Differences from the torch path, by the AOT contract: one kernel and no workspace, so
no split-K (long contexts at small batch use fewer SMs than the torch path); the float attributes
become compile-time constants of the PTX (AOT extra arguments are int32 only).

Kernel parameters. TensorRT launches with (inputs, int32 extra arguments, outputs), the order of
``mla_triton.mla_verify_trt_kernel``. Triton >= 3.3 appends two pointer parameters (global and
profile scratch) that TensorRT would not pass; ``drop_scratch_params`` removes them from the PTX,
which is valid only while the kernel uses no scratch (checked). First thing to confirm on a
machine with TensorRT: an engine with this plugin against the torch op on random inputs.
"""

from __future__ import annotations

import logging
import math
import re

from .plans import make_plan

log = logging.getLogger(__name__)

PLUGIN_ID = "k3trt::mla_verify"
ATTRS = ("q_per_req", "softmax_scale", "kv_scale", "d_v", "dcp_size", "dcp_rank", "dcp_interleave",
         "sparse_chunk", "sparse_sink", "sparse_stride", "sparse_recent")
_TRITON_TYPE = {"BF16": "bf16", "HALF": "fp16", "FP16": "fp16", "FP8": "fp8e4nv"}
_registered = False


def compile_ptx(q_type: str, kv_type: str, *, num_heads: int, width: int, page: int,
                q_per_req: int, softmax_scale: float, kv_scale: float = 1.0, d_v: int = 512,
                sparse: bool = False, capacity: int | None = None, target_cc: int = 90):
    """PTX of the TensorRT entry kernel for one build configuration.

    q_type / kv_type are TensorRT type names ("BF16", "FP16", "FP8"). Returns (kernel name, PTX
    text, num_warps, shared bytes, plan) where plan (plans.VerifyPlan) fixes the grid."""
    # triton (and the kernel module, which imports it) only when a TensorRT build asks for PTX
    import triton  # noqa: PLC0415 (optional: triton)
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415 (optional: triton)

    from . import mla_triton  # noqa: PLC0415 (optional: triton)

    # without a static batch, assume a full GPU's worth of requests (the large-batch tiles)
    plan = make_plan(capacity or 1024, q_per_req, num_heads, width, d_v, kv_fp8=kv_type == "FP8",
                     num_splits=1)
    cfg = plan.config
    block_n = math.gcd(cfg.block_n, page)
    fn = mla_triton.mla_verify_trt_kernel
    qt, kt = _TRITON_TYPE[q_type], _TRITON_TYPE[kv_type]
    pointers = {"Q": f"*{qt}", "KV": f"*{kt}", "BT": "*i32", "SL": "*i32", "O": f"*{qt}",
                "LSE": "*fp32"}
    constants = dict(QK_SCALE=softmax_scale * kv_scale * mla_triton.LOG2E, V_SCALE=kv_scale,
                     PAGE=page, DV=d_v, DR=width - d_v, BLOCK_M=cfg.block_m, BLOCK_N=block_n,
                     CHUNK_PAGES=triton.next_power_of_2(max(1, mla_triton.CHUNK_TOKENS // page)),
                     TILES_PER_PAGE=page // block_n, SPARSE=sparse, KV_FP8=kv_type == "FP8",
                     DV_SPLIT=cfg.dv_split)
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32")
                 for name in fn.arg_names}
    # TensorRT's buffers are at least 256-byte aligned, so every pointer may assume 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in pointers}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", target_cc, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    if getattr(kernel.metadata, "global_scratch_size", 0) or getattr(
            kernel.metadata, "profile_scratch_size", 0):
        raise RuntimeError("mla_verify_trt: kernel needs Triton scratch, which the AOT plugin "
                           "contract cannot provide")
    name = kernel.metadata.name
    ptx = drop_scratch_params(kernel.asm["ptx"], name, len(signature) - len(constants))
    return name, ptx, cfg.num_warps, kernel.metadata.shared, plan


def drop_scratch_params(ptx: str, name: str, n_params: int) -> str:
    """Remove the entry parameters past the first `n_params` (Triton's scratch pointers), which
    TensorRT does not pass; refuses if the body reads one of them."""
    extra = re.findall(rf"\.param [^\n]*?({re.escape(name)}_param_(\d+))", ptx)
    dropped = [p for p, i in extra if int(i) >= n_params]
    body = ptx[ptx.index("{", ptx.index(f".entry {name}")):]
    for p in dropped:
        if re.search(rf"\[{p}\]", body):
            raise RuntimeError(f"mla_verify_trt: kernel reads {p}; cannot drop it")
        ptx = re.sub(rf",?\s*\.param [^\n,]*{p}(?=[,\s)])", "", ptx)
    return ptx


def register(target_cc: int = 90) -> None:
    """Register the plugin with TensorRT's plugin registry (idempotent)."""
    global _registered
    if _registered:
        return
    import tensorrt as trt  # noqa: PLC0415 (optional: tensorrt)
    import tensorrt.plugin as trtp  # noqa: PLC0415 (optional: tensorrt)

    @trtp.register(PLUGIN_ID)
    def _desc(q: trtp.TensorDesc, kv_cache: trtp.TensorDesc, block_table: trtp.TensorDesc,
              seq_lens: trtp.TensorDesc, q_per_req: int, softmax_scale: float, kv_scale: float,
              d_v: int, dcp_size: int, dcp_rank: int, dcp_interleave: int, sparse_chunk: int,
              sparse_sink: int, sparse_stride: int, sparse_recent: int,
              ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        rows, heads = q.shape_expr[0], q.shape_expr[1]
        return (trtp.from_shape_expr((rows, heads, d_v), dtype=q.dtype),
                trtp.from_shape_expr((rows, heads), dtype=trt.float32))

    @trtp.autotune(PLUGIN_ID)
    def _autotune(q, kv_cache, block_table, seq_lens, outputs):
        # '|' ties q, kv and out to one 16-bit type; fp8 KV pairs with either
        return [trtp.AutoTuneCombination("BF16|FP16, BF16|FP16, INT32, INT32, BF16|FP16, FP32",
                                         "LINEAR"),
                trtp.AutoTuneCombination("BF16|FP16, FP8, INT32, INT32, BF16|FP16, FP32",
                                         "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale, d_v,
             dcp_size, dcp_rank, dcp_interleave, sparse_chunk, sparse_sink, sparse_stride,
             sparse_recent, outputs, tactic):
        dims = [q.shape_expr[1], q.shape_expr[2], kv_cache.shape_expr[1]]
        if not all(d.is_constant for d in dims):
            raise ValueError("mla_verify plugin: heads, width and page size must be static")
        heads, width, page = (d.constant_value() for d in dims)
        capacity = block_table.shape_expr[0]
        name, ptx, warps, shared, plan = compile_ptx(
            q.dtype.name, kv_cache.dtype.name, num_heads=heads, width=width, page=page,
            q_per_req=q_per_req, softmax_scale=softmax_scale, kv_scale=kv_scale, d_v=d_v,
            sparse=sparse_chunk > 0 and sparse_stride > 1,
            capacity=capacity.constant_value() if capacity.is_constant else None,
            target_cc=target_cc)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = plan.m_tiles * plan.config.dv_split
        launch.grid_z = capacity
        launch.block_x = warps * 32
        launch.shared_mem = shared
        ints = [block_table.shape_expr[1], heads * q_per_req, heads, q_per_req, dcp_size,
                dcp_rank, dcp_interleave, sparse_chunk, sparse_sink, sparse_stride, sparse_recent]
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in ints])
        return name.encode(), ptx.encode(), launch, extra

    _registered = True
    log.info("registered TensorRT plugin %s (AOT, sm_%d)", PLUGIN_ID, target_cc)
