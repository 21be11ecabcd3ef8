"""The builder: checks before a build, ONNX export, TensorRT engines, content-keyed reuse; it writes
the engine format (k3trt.engine)."""
