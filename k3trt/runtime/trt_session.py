"""A TensorRT / TensorRT-RTX engine session behind the runtime's EngineSession interface.

Not run in this workplace (no GPU here runs a TensorRT-family engine, see ENVIRONMENT.md): the
parts that need no GPU (bindings and shapes from the engine dir, capacity choice, padding, buffer
sizes) are unit-tested; the rest is written to the TensorRT and cuda-python documentation, with
``tensorrt``/``tensorrt_rtx_bindings`` and ``cuda.bindings`` imported only when a session opens.

Per capacity engine (files of builder/tensorrt.py: ``{name}.engine`` + ``{name}.engine.json``):
one execution context, its step inputs staged in pinned host memory and copied to device
buffers, its enqueue captured as a CUDA graph per cache-buffer parity, all on one stream.
Weights: one device copy, read from ``weights.bin`` by the manifests, bound to every engine.

Caches: the graphs are functional (each cache X comes back as X_out; engine/graph_io.py). Unless the
engine's cache-writing nodes alias their output to their input (``alias_caches=True``, for
plugin engines that declare it), an output must not be bound to its input's memory, so every
cache tensor has two buffers and flips parity when an engine writes it (verify engines also
write the per-position KDA states, prefill engines do not). Cost: twice the cache memory.

The graph contract (padding, scratch slot, prefill slices, KDA rollback of short requests) is
kept by ``CapacitySession`` (runtime/engine_io.py), shared with the onnxruntime session; this
module runs one engine and moves cache rows on the GPU. ``close()`` frees what it allocated.
"""

from __future__ import annotations

import ctypes
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3trt.config import ModelConfig
from k3trt.engine.backends import load_backend, runnable_here
from k3trt.engine.capacities import Capacities
from k3trt.engine.graph_io import DYNAMIC_DIMS, GraphSpec, graph_specs, io_specs
from k3trt.runtime.engine_io import Binding, CapacitySession
from k3trt.trt_plugin.loader import load_into

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLayout:
    spec: GraphSpec
    engine: Path
    bindings: tuple[Binding, ...]           # step inputs, caches, weights, outputs (engine order may differ)
    weights: tuple[dict, ...]               # manifest entries: name, dtype, shape, location, offset, length

    def binding(self, name: str) -> Binding:
        return next(b for b in self.bindings if b.name == name)

    @property
    def step_inputs(self) -> tuple[Binding, ...]:
        caches = {b.name[:-4] for b in self.bindings if b.name.endswith("_out")}
        weights = {w["name"] for w in self.weights}
        return tuple(b for b in self.bindings if b.is_input and b.name not in caches and b.name not in weights)

    @property
    def cache_names(self) -> tuple[str, ...]:
        return tuple(b.name[:-4] for b in self.bindings if b.name.endswith("_out"))


def engine_layouts(rank_dir: str | Path, cfg: ModelConfig, *, verify: tuple[int, ...], prefill: tuple[int, ...],
                   spec_tokens: int, block_size: int, max_seq_len: int, dtype: torch.dtype,
                   kv_dtype: torch.dtype, num_blocks: int, num_slots: int) -> dict[str, EngineLayout]:
    """Every capacity engine's bindings with concrete shapes (num_slots includes the scratch slot).
    Refuses a rank dir that lacks an engine or manifest, saying which."""
    rank_dir = Path(rank_dir)
    caps = Capacities(tuple(verify), tuple(prefill), spec_tokens)
    dims = {"num_blocks": num_blocks, "num_slots": num_slots}
    assert set(dims) == set(DYNAMIC_DIMS)
    out = {}
    for spec in graph_specs(cfg, caps, block_size=block_size, max_seq_len=max_seq_len, dtype=dtype, kv_dtype=kv_dtype):
        engine, manifest = rank_dir / f"{spec.name}.engine", rank_dir / f"{spec.name}.engine.json"
        for f in (engine, manifest):
            if not f.is_file():
                raise FileNotFoundError(f"{f} is missing: the engine dir was not built for capacity {spec.name} "
                                        "(rebuild it with `k3trt build ... --backend tensorrt|tensorrt-rtx`)")
        weights = tuple(json.loads(manifest.read_text())["weights"])
        ins, outs = io_specs(cfg, spec)
        bindings = [Binding(t.name, tuple(dims.get(d, d) for d in t.shape), t.dtype, True) for t in ins]
        bindings += [Binding(w["name"], tuple(w["shape"]), _torch_dtype(w["dtype"]), True) for w in weights]
        bindings += [Binding(t.name, tuple(dims.get(d, d) for d in t.shape), t.dtype, False) for t in outs]
        out[spec.name] = EngineLayout(spec, engine, tuple(bindings), weights)
    return out


def _torch_dtype(numpy_name: str) -> torch.dtype:
    names = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32,
             "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}
    if numpy_name not in names:
        raise ValueError(f"weight dtype {numpy_name!r} has no device binding here")
    return names[numpy_name]


def cache_bytes(layouts: dict[str, EngineLayout], *, alias: bool) -> int:
    """Device bytes of the caches every engine shares (x2 without aliasing: the parity buffers)."""
    seen = {}
    for lay in layouts.values():
        for name in lay.cache_names:
            seen[name] = lay.binding(name).nbytes
    return sum(seen.values()) * (1 if alias else 2)


# ------------------------------------------------------------------------------ CUDA (cuda.bindings)
@dataclass(frozen=True)
class DeviceArray:
    ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return Binding("", self.shape[1:], self.dtype, True).nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        # only fp32 logits are handed to torch this way (numpy has no bf16 typestr)
        return {"shape": self.shape, "typestr": "<f4", "data": (self.ptr, False), "version": 3}


class Cuda:
    """The few runtime calls the session needs, on one device and one stream."""

    def __init__(self, device: int):
        from cuda.bindings import runtime as rt  # noqa: PLC0415 (optional: cuda-python)

        self.rt = rt
        self._ok(rt.cudaSetDevice(device))
        self.stream = self._ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        self._owned: list[int] = []             # device buffers
        self._pinned: list[int] = []            # pinned host buffers
        self._graphs: list[object] = []         # instantiated CUDA graphs

    def _ok(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA error {err}")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    def alloc(self, shape, dtype: torch.dtype) -> DeviceArray:
        nbytes = Binding("", tuple(shape), dtype, True).nbytes
        ptr = self._ok(self.rt.cudaMalloc(max(nbytes, 1)))
        self._owned.append(int(ptr))
        return DeviceArray(int(ptr), tuple(shape), dtype)

    def zeros(self, shape, dtype: torch.dtype) -> DeviceArray:
        a = self.alloc(shape, dtype)
        self._ok(self.rt.cudaMemset(a.ptr, 0, Binding("", a.shape, dtype, True).nbytes))
        return a

    def pinned(self, nbytes: int):
        ptr = int(self._ok(self.rt.cudaMallocHost(max(nbytes, 1))))
        self._pinned.append(ptr)
        return ptr, np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))

    def h2d(self, dst: int, src: int, nbytes: int) -> None:
        self._ok(self.rt.cudaMemcpyAsync(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def copy_row(self, dst: DeviceArray, drow: int, src: DeviceArray, srow: int, sub: int | None = None) -> None:
        """dst[drow] = src[srow] (or src[srow, sub] for per-position states), on the stream."""
        n = dst.row_bytes
        off = srow * src.row_bytes + (sub * n if sub is not None else 0)
        self._ok(self.rt.cudaMemcpyAsync(dst.ptr + drow * n, src.ptr + off, n,
                                         self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    def zero_row(self, a: DeviceArray, row: int) -> None:
        self._ok(self.rt.cudaMemsetAsync(a.ptr + row * a.row_bytes, 0, a.row_bytes, self.stream))

    def load_weights(self, rank_dir: Path, entries: list[dict]) -> dict[str, DeviceArray]:
        out = {}
        for w in entries:
            if w["name"] in out:
                continue
            blob = np.fromfile(rank_dir / w["location"], dtype=np.uint8, count=w["length"], offset=w["offset"])
            a = self.alloc(tuple(w["shape"]), _torch_dtype(w["dtype"]))
            self._ok(self.rt.cudaMemcpy(a.ptr, blob.ctypes.data, w["length"],
                                        self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
            out[w["name"]] = a
        return out

    def capture(self, enqueue) -> object:
        """A CUDA graph of what `enqueue(stream)` puts on the stream, instantiated."""
        rt = self.rt
        self._ok(rt.cudaStreamBeginCapture(self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        try:
            enqueue(self.stream)
        finally:
            graph = self._ok(rt.cudaStreamEndCapture(self.stream))
        try:
            graph_exec = self._ok(rt.cudaGraphInstantiate(graph, 0))
        finally:
            self._ok(rt.cudaGraphDestroy(graph))        # the executable graph does not need it
        self._graphs.append(graph_exec)
        return graph_exec

    def launch(self, graph_exec) -> None:
        self._ok(self.rt.cudaGraphLaunch(graph_exec, self.stream))

    def synchronize(self) -> None:
        self._ok(self.rt.cudaStreamSynchronize(self.stream))

    def close(self) -> None:
        """Free every graph, buffer and the stream this object made (after the work queued on the
        stream); idempotent."""
        if self.stream is None:
            return
        rt = self.rt
        self._ok(rt.cudaStreamSynchronize(self.stream))
        for g in self._graphs:
            self._ok(rt.cudaGraphExecDestroy(g))
        for ptr in self._owned:
            self._ok(rt.cudaFree(ptr))
        for ptr in self._pinned:
            self._ok(rt.cudaFreeHost(ptr))
        self._graphs, self._owned, self._pinned = [], [], []
        self._ok(rt.cudaStreamDestroy(self.stream))
        self.stream = None


class EngineRunner:
    """One capacity engine: its context, step-input buffers, logits buffer and CUDA graphs."""

    def __init__(self, cuda: Cuda, runtime, layout: EngineLayout, weights: dict[str, DeviceArray], graphs: bool):
        self.cuda, self.layout, self.use_graphs = cuda, layout, graphs
        self.engine = runtime.deserialize_cuda_engine(layout.engine.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{layout.engine}: the engine does not deserialize on this GPU (built for another "
                               "target or TensorRT version?); rebuild it for this GPU")
        self.context = self.engine.create_execution_context()
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        known = {b.name for b in layout.bindings}
        if names != known:
            raise RuntimeError(f"{layout.engine.name}: engine bindings differ from the layout: missing "
                               f"{sorted(known - names)[:5]}, unexpected {sorted(names - known)[:5]}")
        self.step = {b.name: (cuda.alloc(b.shape, b.dtype), *cuda.pinned(b.nbytes)) for b in layout.step_inputs}
        self.logits = cuda.alloc(layout.binding("logits").shape, torch.float32)
        for b in layout.bindings:
            if b.is_input:
                self.context.set_input_shape(b.name, b.shape)
        fixed = {**{n: v[0] for n, v in self.step.items()}, **weights, "logits": self.logits}
        for name, arr in fixed.items():
            if name in names:
                self.context.set_tensor_address(name, arr.ptr)
        self.graphs: dict[tuple, object] = {}

    def run(self, host_inputs: dict[str, torch.Tensor], caches: dict[str, DeviceArray], key: tuple) -> DeviceArray:
        for name, (dev, host_ptr, host) in self.step.items():
            src = host_inputs[name].contiguous().view(torch.uint8).numpy().reshape(-1)
            host[:src.size] = src
            self.cuda.h2d(dev.ptr, host_ptr, src.size)
        for name, arr in caches.items():
            self.context.set_tensor_address(name, arr.ptr)

        def enqueue(stream):
            if not self.context.execute_async_v3(int(stream)):
                raise RuntimeError(f"{self.layout.engine.name}: enqueue failed")

        if not self.use_graphs:
            enqueue(self.cuda.stream)
        else:
            if key not in self.graphs:
                enqueue(self.cuda.stream)          # TensorRT: one plain enqueue before capturing
                self.graphs[key] = self.cuda.capture(enqueue)
            else:
                self.cuda.launch(self.graphs[key])
        self.cuda.synchronize()
        return self.logits

    def close(self) -> None:
        """Drop the TensorRT objects (context before engine); the buffers are the Cuda object's."""
        self.graphs.clear()
        self.context = None
        self.engine = None


# ------------------------------------------------------------------------------ the session
class EngineNotRunnable(RuntimeError):
    """Engines this machine cannot run (no GPU, another GPU architecture, backend not installed)."""


def check_runnable(rank_dir: str | Path, backend: str, target: str | None) -> None:
    """Refuse, before any CUDA or TensorRT call, engines this machine cannot run, saying why
    (`target`: the engine dir's; None skips the architecture comparison)."""
    reason = runnable_here(backend, target)
    if reason is not None:
        raise EngineNotRunnable(f"cannot run the {backend} engines of {rank_dir} (target {target or '?'}) on this "
                                f"machine: {reason}")


class TrtSession(CapacitySession):
    """Engines of one rank dir on one GPU. `plan` is the runtime's CachePlan; one KDA slot is added
    past plan.num_slots as the scratch slot of padded verify requests. `close()` frees every
    device and pinned buffer, CUDA graph and the stream."""

    def __init__(self, rank_dir: str | Path, cfg: ModelConfig, plan, *, backend: str, verify: tuple[int, ...],
                 prefill: tuple[int, ...], spec_tokens: int, max_seq_len: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: str = "cuda:0", alias_caches: bool = False, cuda_graphs: bool = True,
                 target: str | None = None, plugin_library: Path | None = None):
        check_runnable(rank_dir, backend, target)
        self.cfg, self.plan, self.device = cfg, plan, torch.device(device)
        self.scratch_slot = plan.num_slots
        self.layouts = engine_layouts(rank_dir, cfg, verify=verify, prefill=prefill, spec_tokens=spec_tokens,
                                      block_size=plan.block_size, max_seq_len=max_seq_len, dtype=dtype,
                                      kv_dtype=kv_dtype, num_blocks=plan.num_blocks, num_slots=plan.num_slots + 1)
        self.specs = {n: lay.spec for n, lay in self.layouts.items()}
        self.verify_caps, self.prefill_caps = tuple(verify), tuple(prefill)
        self.rope = any(b.name == "positions" for lay in self.layouts.values() for b in lay.bindings)
        self.alias, self.cuda_graphs = alias_caches, cuda_graphs
        self.cuda = Cuda(self.device.index or 0)
        try:
            self.trt = load_backend(backend).trt
            if plugin_library is not None:         # the engines' plugin layers deserialize through it
                load_into(self.trt, plugin_library, rtx=backend == "tensorrt-rtx")
            self.weights = self.cuda.load_weights(Path(rank_dir),
                                                  [w for lay in self.layouts.values() for w in lay.weights])
            self.caches = {}                    # name -> [buffer parity 0, buffer parity 1 (or the same)]
            for lay in self.layouts.values():
                for name in lay.cache_names:
                    if name not in self.caches:
                        a = self.cuda.zeros(lay.binding(name).shape, lay.binding(name).dtype)
                        self.caches[name] = [a, a if self.alias else self.cuda.zeros(a.shape, a.dtype)]
            self.cache_names = frozenset(self.caches)
            self.parity = {name: 0 for name in self.caches}
            runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
            self.engines = {n: EngineRunner(self.cuda, runtime, lay, self.weights, cuda_graphs)
                            for n, lay in self.layouts.items()}
        except BaseException:
            self.cuda.close()
            raise
        log.info("TensorRT session: %d engines, caches %.1f MiB (%s)", len(self.engines),
                 cache_bytes(self.layouts, alias=self.alias) / 2**20, "aliased" if self.alias else "double-buffered")

    def close(self) -> None:
        """Free what the session allocated (execution contexts and engines first: they use the
        buffers). Idempotent; the session is unusable afterwards."""
        for runner in getattr(self, "engines", {}).values():
            runner.close()
        self.engines = {}
        self.cuda.close()

    # -- helpers over the parity buffers
    def _cache(self, name: str, which: str = "in"):
        p = self.parity[name]
        return self.caches[name][p if which == "in" or self.alias else 1 - p]

    # -- CapacitySession primitives
    def _run(self, name: str, host_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        lay = self.layouts[name]
        addrs = {c: self._cache(c, "in") for c in lay.cache_names}
        addrs.update({f"{c}_out": self._cache(c, "out") for c in lay.cache_names})
        logits = self.engines[name].run(host_inputs, addrs, key=tuple(self.parity[c] for c in lay.cache_names))
        if not self.alias:
            for c in lay.cache_names:
                self.parity[c] ^= 1
        return torch.as_tensor(logits, device=self.device)

    def _zero_row(self, cache: str, row: int) -> None:
        self.cuda.zero_row(self._cache(cache), row)

    def _copy_row(self, dst: str, drow: int, src: str, srow: int, sub: int | None = None) -> None:
        self.cuda.copy_row(self._cache(dst), drow, self._cache(src), srow, sub)

    def _sync(self) -> None:
        self.cuda.synchronize()
