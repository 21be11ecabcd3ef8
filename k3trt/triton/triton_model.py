"""The model.py of a k3trt Triton model (copied by `k3trt triton-repo`; rewrite the repository
rather than editing it).

Triton's Python backend runs this file in a stub process whose interpreter ignores PYTHONPATH,
so k3trt is found through the `k3trt_python_path` parameter of config.pbtxt (put first on
sys.path; empty: the stub's environment must provide k3trt). The `k3trt_role` parameter picks the
implementation: `engine` (k3trt.triton.engine_model) or `unary` (k3trt.triton.unary_model).
Standard library only until k3trt is importable.
"""

import json
import os
import sys


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v.get("string_value", "") for k, v in
                  json.loads(args["model_config"]).get("parameters", {}).items()}
        path = params.get("k3trt_python_path", "")
        if path:
            if not os.path.isdir(os.path.join(path, "k3trt")):
                raise RuntimeError(f"k3trt_python_path {path!r} holds no k3trt package; rewrite the repository "
                                   "with `k3trt triton-repo` or set the parameter to the right directory")
            if path not in sys.path:
                sys.path.insert(0, path)
        role = params.get("k3trt_role", "engine")
        if role == "engine":
            from k3trt.triton.engine_model import EngineModel as Impl  # noqa: PLC0415 (after the sys.path insert)
        elif role == "unary":
            from k3trt.triton.unary_model import UnaryModel as Impl  # noqa: PLC0415 (after the sys.path insert)
        else:
            raise RuntimeError(f"unknown k3trt_role {role!r} (engine or unary)")
        self._impl = Impl()
        self._impl.initialize(args, params)

    def execute(self, requests):
        return self._impl.execute(requests)

    def finalize(self):
        impl = getattr(self, "_impl", None)
        if impl is not None:
            impl.finalize()
