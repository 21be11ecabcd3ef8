"""Plugin ops (namespace ``k3trt``): each a torch.library custom op with a plain-torch
reference, a fake implementation, a GPU kernel where one exists, and its ONNX/TensorRT side.

The decode step's fused ops (norm_act, attn_res, kda_front, moe_route, moe_gemm) have no ONNX
side: they exist to cut kernel launches in the torch backend, and under torch.export the model
calls their references instead (model/layers.fused_ops), whose aten ops the exporters know.

Importing this package registers every op, so ``torch.ops.k3trt.<name>`` resolves. The CUDA
kernels are registered here too, but their Triton modules (mla_triton, kda_triton,
cache_write_triton, ...) are imported only on an op's first call with CUDA tensors, so importing
k3trt never needs triton.
"""

from k3trt.plugins import (  # noqa: F401,E402
    attn_res, cache_write, kda, kda_front, merge, mla_verify, moe_gemm, moe_route, norm_act,
)


@cache_write.mla_cache_write.register_kernel("cuda")
def _mla_cache_write_cuda(kv_c, k_pe, cache, slot_mapping, kv_scale):
    # cache_write.py keeps the op and its torch body; the CUDA side (checks without host sync, the
    # Triton kernel, the fallback) lives in cache_write_triton.py, imported lazily as mla_verify
    # imports mla_triton
    from k3trt.plugins import cache_write_triton

    cache_write_triton.mla_cache_write_cuda(kv_c, k_pe, cache, slot_mapping, kv_scale)
