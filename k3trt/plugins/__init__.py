"""Plugin ops (namespace ``k3trt``): each a torch.library custom op with a plain-torch reference, a
fake implementation, a GPU kernel where one exists, and its ONNX/TensorRT side where it has one.

Every op has the same parts in the same places:

    <op>_ref.py     the plain-torch reference(s), the argument checks (``check_<op>``), the
                    constants and layouts the kernels share, and ``<op>_unsupported`` (why the
                    kernel cannot take a call: shapes, dtypes, devices; never a device read).
                    Imports torch and other *_ref modules only.
    <op>.py         the torch.library op(s): registration, fake impl, the CUDA registration
                    (``dispatch.call``: kernel, or reference with one logged warning per reason),
                    and the export description (``ONNX``: node, types, standard-ONNX lowering).
    <op>_triton.py  the GPU kernel and its launcher (``*_fwd``); imports the ref module only.
    The TensorRT plugin of each ONNX node is C++, in k3trt/trt_plugin/src/ (docs/trt_plugins.md).

    family       ops (torch.ops.k3trt.*)                ref              kernel                 export
    attn_res     attn_res                               attn_res_ref     attn_res_triton        -
    cache_write  mla_cache_write                        cache_write_ref  cache_write_triton     MlaCacheWrite (*)
    kda          kda_recurrent, kda_recurrent_slots,    kda_ref          kda_triton (slots),    KdaRecurrent,
                 kda_chunked, short_conv                                 kda_chunk_triton       KdaChunked, ShortConv
    kda_front    short_conv_slots, kda_prep             kda_front_ref    kda_front_triton       -
    norm_act     rms_norm, gated_act, kda_out_gate      norm_act_ref     norm_act_triton        -
    moe_gemm     moe_gemm                               moe_gemm_ref     moe_gemm_triton        MoeExperts (*)
    moe_route    moe_route, moe_combine                 moe_route_ref    moe_route_triton       -
    merge        merge_attn_states                      merge_ref        mla_triton             MergeAttnStates
    mla_verify   mla_verify                             mla_verify_ref,  mla_triton, mla_cuda/  MlaVerify
                                                        dcp, plans

(*) the node of an export-only functional op of graph_ops.py (mla_cache_update, moe_experts).
Shared: dispatch.py (the kernel-or-reference choice and its logging), onnx_spec.py (``OnnxOp``),
dcp_sim.py (a DCP group simulated on one process, for tests), plans.py (the MLA kernels' capacity
plans, read by mla_triton and mla_cuda/).

The decode step's fused ops (norm_act, attn_res, kda_front, moe_route, moe_gemm) have no ONNX
side: they exist to cut kernel launches in the torch backend, and under torch.export the model
calls their references instead (model/layers.fused_ops), whose aten ops the exporters know.

Importing this package registers every op, so ``torch.ops.k3trt.<name>`` resolves, and collects
``ONNX_OPS``, the registry builder/onnx_ops.py iterates over. Kernel modules are imported only on
an op's first call with CUDA tensors, so importing k3trt never needs triton.
"""

from k3trt.plugins import (
    attn_res, cache_write, kda, kda_front, merge, mla_verify, moe_gemm, moe_route, norm_act,
)
from k3trt.plugins.onnx_spec import OnnxOp

__all__ = ["attn_res", "cache_write", "kda", "kda_front", "merge", "mla_verify", "moe_gemm", "moe_route",
           "norm_act", "ONNX_OPS"]

ONNX_OPS: tuple[OnnxOp, ...] = (*mla_verify.ONNX, *cache_write.ONNX, *kda.ONNX, *moe_gemm.ONNX, *merge.ONNX)
