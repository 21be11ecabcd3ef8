"""The k3trt TensorRT plugin library: one C++ ``IPluginV3`` plugin per k3trt ONNX op (src/), built
by ``build.build_library`` (nvcc, cached by content), and a TensorRT-free harness that runs each
plugin's runtime half on torch CUDA tensors (harness.py). docs/trt_plugins.md describes the design
and what TensorRT-RTX does with the library."""
