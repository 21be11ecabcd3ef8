"""Plugin ops (namespace ``k3trt``): each a torch.library custom op with a plain-torch
reference, a fake implementation, a GPU kernel where one exists, and its ONNX/TensorRT side.

Importing this package registers every op, so ``torch.ops.k3trt.<name>`` resolves.
"""

from k3trt.plugins import cache_write, kda, merge, mla_verify  # noqa: F401,E402
