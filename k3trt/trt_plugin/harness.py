"""Run a plugin's runtime half without TensorRT: the harness shim (harness/harness.cpp) loads the
plugin library, creates the plugin through its creator with the fields an ONNX node carries, makes
the build-phase queries TensorRT makes (output types and shapes, formats, configurePlugin,
workspace, aliasing), recreates it from its serialized fields as engine loading does, attaches it
to a context, and enqueues on torch CUDA tensors on the current stream.

    h = PluginHarness()                                 # builds (or takes from the cache) both .so
    out, lse = h.run("MergeAttnStates", [out_a, lse_a, out_b, lse_b])
    h.output_specs("MlaVerify", [(torch.bfloat16, (8, 16, 576)), ...], {"q_per_req": 2, ...})  # no GPU needed

Attributes map to fields by the creator's declared kinds, as TensorRT's ONNX parser maps a node's
attributes: INT -> kINT32, FLOAT -> kFLOAT32, STRING -> kCHAR.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3trt.trt_plugin.build import DEFAULT_ARCHS, build_harness, build_library

# nvinfer1::DataType values
TRT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.int32: 3, torch.bool: 4, torch.uint8: 5,
              torch.float8_e4m3fn: 6, torch.bfloat16: 7, torch.int64: 8}
TORCH_DTYPES = {v: k for k, v in TRT_DTYPES.items()}
# nvinfer1::PluginFieldType values the creators declare
FIELD_INT32, FIELD_FLOAT32, FIELD_CHAR = 5, 1, 6
MAX_DIMS, MAX_OUTPUTS = 8, 8
NAMESPACE, VERSION = "k3trt", "1"


class HarnessError(RuntimeError):
    """A plugin call failed; the message is the shim's (the library logs the detail to stderr)."""


@dataclass(frozen=True)
class CreatorInfo:
    name: str
    namespace: str
    version: str
    fields: tuple[tuple[str, int], ...]     # (name, PluginFieldType value)


@dataclass(frozen=True)
class OutputSpecs:
    outputs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    workspace: int
    aliased: tuple[int, ...]                # per output: the aliased input's index, or -1


class PluginHarness:
    def __init__(self, library: str | Path | None = None, archs: Sequence[str] = DEFAULT_ARCHS):
        self.library = Path(library) if library else build_library(tuple(archs))
        self._dll = ctypes.CDLL(str(build_harness()))
        d = self._dll
        P, I32, Err = ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p
        d.k3h_open.argtypes, d.k3h_open.restype = [ctypes.c_char_p, Err, I32], P
        d.k3h_describe.argtypes, d.k3h_describe.restype = [P, ctypes.c_char_p, I32], I32
        d.k3h_create.argtypes = [P, ctypes.c_char_p, I32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(I32),
                                 ctypes.POINTER(P), ctypes.POINTER(I32), Err, I32]
        d.k3h_create.restype = P
        d.k3h_configure.argtypes = [P, I32, ctypes.POINTER(I32), ctypes.POINTER(I32), ctypes.POINTER(ctypes.c_int64),
                                    ctypes.POINTER(I32), ctypes.POINTER(I32), ctypes.POINTER(I32),
                                    ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                                    ctypes.POINTER(I32), Err, I32]
        d.k3h_configure.restype = I32
        d.k3h_enqueue.argtypes, d.k3h_enqueue.restype = [P, ctypes.POINTER(P), ctypes.POINTER(P), P, P, Err, I32], I32
        d.k3h_destroy.argtypes, d.k3h_destroy.restype = [P], None
        err = ctypes.create_string_buffer(1024)
        self._lib = d.k3h_open(str(self.library).encode(), err, len(err))
        if not self._lib:
            raise HarnessError(f"{self.library}: {err.value.decode()}")

    # ------------------------------------------------------------------ creators
    def creators(self) -> dict[str, CreatorInfo]:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self._dll.k3h_describe(self._lib, buf, len(buf))
        if n < 0:
            raise HarnessError("creator description too long")
        out = {}
        for line in buf.value.decode().splitlines():
            name, ns, version, *fields = line.split("\t")
            out[name] = CreatorInfo(name, ns, version,
                                    tuple((f.split(":")[0], int(f.split(":")[1])) for f in fields))
        return out

    # ------------------------------------------------------------------ one call
    def _create(self, op: str, attrs: dict[str, Any]):
        info = self.creators().get(op)
        if info is None:
            raise HarnessError(f"the library has no plugin {op!r}")
        kinds = dict(info.fields)
        unknown = set(attrs) - set(kinds)
        if unknown:
            raise HarnessError(f"{op}: no fields {sorted(unknown)} (the creator declares {sorted(kinds)})")
        keep, names, types, data, lengths = [], [], [], [], []
        for name, value in attrs.items():
            kind = kinds[name]
            if kind == FIELD_INT32:
                buf, length = ctypes.c_int32(int(value)), 1
            elif kind == FIELD_FLOAT32:
                buf, length = ctypes.c_float(float(value)), 1
            elif kind == FIELD_CHAR:
                raw = str(value).encode()
                buf, length = ctypes.create_string_buffer(raw), len(raw)
            else:
                raise HarnessError(f"{op}.{name}: field type {kind} not handled")
            keep.append(buf)
            names.append(name.encode())
            types.append(kind)
            data.append(ctypes.cast(ctypes.pointer(buf), ctypes.c_void_p))
            lengths.append(length)
        n = len(names)
        err = ctypes.create_string_buffer(1024)
        sess = self._dll.k3h_create(self._lib, op.encode(), n, (ctypes.c_char_p * n)(*names), (ctypes.c_int32 * n)(*types),
                                    (ctypes.c_void_p * n)(*data), (ctypes.c_int32 * n)(*lengths), err, len(err))
        if not sess:
            raise HarnessError(err.value.decode())
        return sess

    def _configure(self, sess, specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> OutputSpecs:
        n = len(specs)
        dims = (ctypes.c_int64 * (n * MAX_DIMS))()
        for i, (_, shape) in enumerate(specs):
            for j, s in enumerate(shape):
                dims[i * MAX_DIMS + j] = int(s)
        nout = ctypes.c_int32()
        otypes, oranks = (ctypes.c_int32 * MAX_OUTPUTS)(), (ctypes.c_int32 * MAX_OUTPUTS)()
        odims, ws = (ctypes.c_int64 * (MAX_OUTPUTS * MAX_DIMS))(), ctypes.c_int64()
        aliased, err = (ctypes.c_int32 * MAX_OUTPUTS)(), ctypes.create_string_buffer(1024)
        rc = self._dll.k3h_configure(sess, n, (ctypes.c_int32 * n)(*(TRT_DTYPES[dt] for dt, _ in specs)),
                                     (ctypes.c_int32 * n)(*(len(s) for _, s in specs)), dims, ctypes.byref(nout),
                                     otypes, oranks, odims, ctypes.byref(ws), aliased, err, len(err))
        if rc != 0:
            raise HarnessError(err.value.decode())
        outs = tuple((TORCH_DTYPES[otypes[o]], tuple(odims[o * MAX_DIMS + j] for j in range(oranks[o])))
                     for o in range(nout.value))
        return OutputSpecs(outs, ws.value, tuple(aliased[o] for o in range(nout.value)))

    def output_specs(self, op: str, inputs: Sequence[tuple[torch.dtype, Sequence[int]]],
                     attrs: dict[str, Any] | None = None) -> OutputSpecs:
        """The build-phase answers for these input dtypes/shapes (runs on a machine without a GPU)."""
        sess = self._create(op, attrs or {})
        try:
            return self._configure(sess, inputs)
        finally:
            self._dll.k3h_destroy(sess)

    def run(self, op: str, inputs: Sequence[torch.Tensor], attrs: dict[str, Any] | None = None, *,
            in_place: bool = False, poison: bool = True) -> list[torch.Tensor]:
        """Enqueue `op` on CUDA `inputs` (made contiguous) and return its outputs. Outputs are
        NaN-poisoned first (integers: -1) so that an element the kernel skips shows. `in_place`:
        an output aliased to an input (getAliasedInput) is that input's buffer, as TensorRT binds
        it with aliased plugin I/O on; otherwise it is a fresh buffer, as without it."""
        with self.prepare(op, inputs, attrs, in_place=in_place, poison=poison) as call:
            call.enqueue()
            torch.cuda.synchronize(call.outputs[0].device if call.outputs else None)
            return call.outputs

    def prepare(self, op: str, inputs: Sequence[torch.Tensor], attrs: dict[str, Any] | None = None, *,
                in_place: bool = False, poison: bool = True) -> "PreparedCall":
        """`run` split in two for timing: the plugin created, configured and its buffers allocated
        once; ``enqueue()`` then launches it on the current stream without a sync (a CUDA graph
        can capture it). Use as a context manager, or ``close()`` it."""
        inputs = [t.contiguous() for t in inputs]
        sess = self._create(op, attrs or {})
        try:
            spec = self._configure(sess, [(t.dtype, tuple(t.shape)) for t in inputs])
            device = inputs[0].device
            outs = []
            for o, (dtype, shape) in enumerate(spec.outputs):
                if in_place and spec.aliased[o] >= 0:
                    outs.append(inputs[spec.aliased[o]])
                    continue
                t = torch.empty(shape, dtype=dtype, device=device)
                if poison:
                    _poison(t)
                outs.append(t)
            workspace = torch.empty(max(spec.workspace, 1), dtype=torch.uint8, device=device)
        except BaseException:
            self._dll.k3h_destroy(sess)
            raise
        return PreparedCall(self._dll, sess, inputs, outs, workspace)


class PreparedCall:
    """One configured plugin over fixed device buffers (PluginHarness.prepare)."""

    def __init__(self, dll, sess, inputs: list[torch.Tensor], outputs: list[torch.Tensor], workspace: torch.Tensor):
        self._dll, self._sess = dll, sess
        self.inputs, self.outputs, self.workspace = inputs, outputs, workspace
        self._in = (ctypes.c_void_p * len(inputs))(*(t.data_ptr() for t in inputs))
        self._out = (ctypes.c_void_p * len(outputs))(*(t.data_ptr() for t in outputs))
        self._err = ctypes.create_string_buffer(1024)

    def enqueue(self) -> None:
        if self._sess is None:
            raise HarnessError("enqueue on a closed PreparedCall")
        stream = torch.cuda.current_stream(self.inputs[0].device).cuda_stream
        rc = self._dll.k3h_enqueue(self._sess, self._in, self._out, self.workspace.data_ptr(), stream, self._err,
                                   len(self._err))
        if rc != 0:
            raise HarnessError(self._err.value.decode())

    def close(self) -> None:
        if self._sess is not None:
            self._dll.k3h_destroy(self._sess)
            self._sess = None

    def __enter__(self) -> "PreparedCall":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _poison(t: torch.Tensor) -> None:
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)         # e4m3fn NaN
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
