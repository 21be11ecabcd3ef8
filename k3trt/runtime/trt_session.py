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

The graph contract the session keeps (engine/graph_io.py): verify engines run B_cap requests x
Q rows; padded requests use the scratch KDA slot (one slot past the plan's), slot_mapping -1 and
seq_lens Q; a request with fewer than Q rows is padded at its end and its KDA state is then
reset to the state after its last live row. Prefill engines run exactly T tokens of one
sequence; a chunk of n tokens runs as PrefillSlices at the capacities ``split_prefill`` gives; a
fresh sequence's KDA slot is zeroed first.
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
from k3trt.engine.capacities import Capacities, pick, split_prefill
from k3trt.engine.graph_io import DYNAMIC_DIMS, GraphSpec, graph_specs, io_specs
from k3trt.runtime.engine import Batch, EngineSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Binding:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_input: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


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


# ------------------------------------------------------------------------------ step -> engine inputs
def verify_inputs(batch: Batch, spec: GraphSpec, scratch_slot: int, *, positions: bool = False):
    """Host inputs of a verify engine for `batch` and the engine rows of the batch's logit rows."""
    S, Q, B = len(batch.q_lens), spec.q_per_req, spec.capacity
    if S > B or any(q > Q for q in batch.q_lens):
        raise ValueError(f"{spec.name} runs {B} requests x {Q} rows; the step has {S} requests with rows "
                         f"{batch.q_lens}")
    ids = torch.zeros(B * Q, dtype=torch.int64)
    slots = torch.full((B * Q,), -1, dtype=torch.int64)
    pos = torch.zeros(B * Q, dtype=torch.int64)
    table = torch.zeros(B, spec.max_blocks, dtype=torch.int32)
    seq_lens = torch.full((B,), Q, dtype=torch.int32)
    kda = torch.full((B,), scratch_slot, dtype=torch.int64)
    engine_row = torch.empty(batch.num_tokens, dtype=torch.int64)
    t = 0
    for i, (q, c) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        rows = slice(i * Q, i * Q + q)
        ids[rows], slots[rows] = batch.input_ids[t:t + q], batch.slot_mapping[t:t + q]
        pos[rows] = torch.arange(c, c + q)
        engine_row[t:t + q] = torch.arange(i * Q, i * Q + q)
        width = min(batch.block_table.shape[1], spec.max_blocks)
        table[i, :width] = batch.block_table[i, :width]
        seq_lens[i], kda[i] = c + Q, batch.kda_slots[i]      # rows past q only feed padded rows
        t += q
    x = {"input_ids": ids, "slot_mapping": slots, "block_table": table, "seq_lens": seq_lens, "kda_slots": kda}
    if positions:
        x["positions"] = pos
    return x, engine_row[batch.logit_rows]


@dataclass(frozen=True)
class PrefillSlice:
    """One prefill engine run: exactly `capacity` tokens of one sequence's chunk."""
    seq: int          # sequence index in the batch
    start: int        # first token of the slice within the sequence's new tokens
    capacity: int     # tokens (exactly)
    last: bool        # the sequence's last slice: its logits are the sequence's


def prefill_slices(batch: Batch, capacities: tuple[int, ...]) -> list[PrefillSlice]:
    out = []
    for i, n in enumerate(batch.q_lens):
        start, parts = 0, split_prefill(capacities, n)
        for j, cap in enumerate(parts):
            out.append(PrefillSlice(i, start, cap, j == len(parts) - 1))
            start += cap
    return out


def prefill_inputs(batch: Batch, piece: PrefillSlice, spec: GraphSpec, *,
                   positions: bool = False) -> dict[str, torch.Tensor]:
    t0 = sum(batch.q_lens[:piece.seq]) + piece.start
    ctx = batch.ctx_lens[piece.seq] + piece.start
    table = torch.zeros(1, spec.max_blocks, dtype=torch.int32)
    width = min(batch.block_table.shape[1], spec.max_blocks)
    table[0, :width] = batch.block_table[piece.seq, :width]
    x = {"input_ids": batch.input_ids[t0:t0 + piece.capacity].clone(),
         "slot_mapping": batch.slot_mapping[t0:t0 + piece.capacity].clone(), "block_table": table,
         "seq_lens": torch.tensor([ctx + piece.capacity], dtype=torch.int32),
         "kda_slots": batch.kda_slots[piece.seq:piece.seq + 1].clone()}
    if positions:
        x["positions"] = torch.arange(ctx, ctx + piece.capacity)
    return x


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
        self._owned: list[int] = []

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
        return self._ok(rt.cudaGraphInstantiate(graph, 0))

    def launch(self, graph_exec) -> None:
        self._ok(self.rt.cudaGraphLaunch(graph_exec, self.stream))

    def synchronize(self) -> None:
        self._ok(self.rt.cudaStreamSynchronize(self.stream))


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


class TrtSession(EngineSession):
    """Engines of one rank dir on one GPU. `plan` is the runtime's CachePlan; one KDA slot is added
    past plan.num_slots as the scratch slot of padded verify requests."""

    def __init__(self, rank_dir: str | Path, cfg: ModelConfig, plan, *, backend: str, verify: tuple[int, ...],
                 prefill: tuple[int, ...], spec_tokens: int, max_seq_len: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: str = "cuda:0", alias_caches: bool = False, cuda_graphs: bool = True,
                 target: str | None = None):
        check_runnable(rank_dir, backend, target)
        self.cfg, self.plan, self.device = cfg, plan, torch.device(device)
        self.scratch_slot = plan.num_slots
        self.layouts = engine_layouts(rank_dir, cfg, verify=verify, prefill=prefill, spec_tokens=spec_tokens,
                                      block_size=plan.block_size, max_seq_len=max_seq_len, dtype=dtype,
                                      kv_dtype=kv_dtype, num_blocks=plan.num_blocks, num_slots=plan.num_slots + 1)
        self.verify_caps, self.prefill_caps = tuple(verify), tuple(prefill)
        self.rope = any(b.name == "positions" for lay in self.layouts.values() for b in lay.bindings)
        self.alias, self.cuda_graphs = alias_caches, cuda_graphs
        self.cuda = Cuda(self.device.index or 0)
        self.trt = load_backend(backend).trt
        self.weights = self.cuda.load_weights(Path(rank_dir), [w for lay in self.layouts.values() for w in lay.weights])
        self.caches = {}                        # name -> [buffer parity 0, buffer parity 1 (or the same)]
        for lay in self.layouts.values():
            for name in lay.cache_names:
                if name not in self.caches:
                    a = self.cuda.zeros(lay.binding(name).shape, lay.binding(name).dtype)
                    self.caches[name] = [a, a if self.alias else self.cuda.zeros(a.shape, a.dtype)]
        self.parity = {name: 0 for name in self.caches}
        runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        self.engines = {n: EngineRunner(self.cuda, runtime, lay, self.weights, cuda_graphs)
                        for n, lay in self.layouts.items()}
        log.info("TensorRT session: %d engines, caches %.1f MiB (%s)", len(self.engines),
                 cache_bytes(self.layouts, alias=self.alias) / 2**20, "aliased" if self.alias else "double-buffered")

    # -- helpers over the parity buffers
    def _cache(self, name: str, which: str = "in"):
        p = self.parity[name]
        return self.caches[name][p if which == "in" or self.alias else 1 - p]

    def _run(self, name: str, host_inputs: dict[str, torch.Tensor]):
        lay = self.layouts[name]
        addrs = {c: self._cache(c, "in") for c in lay.cache_names}
        addrs.update({f"{c}_out": self._cache(c, "out") for c in lay.cache_names})
        logits = self.engines[name].run(host_inputs, addrs, key=tuple(self.parity[c] for c in lay.cache_names))
        if not self.alias:
            for c in lay.cache_names:
                self.parity[c] ^= 1
        return logits

    def _kda_layers(self) -> list[int]:
        return list(self.cfg.kda_layers)

    # -- EngineSession
    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        if device_ids is not None:
            raise NotImplementedError("the TensorRT session takes token ids from the batch only")
        cap = pick(self.verify_caps, len(batch.q_lens), "verify")
        name = f"verify_b{cap}"
        x, rows = verify_inputs(batch, self.layouts[name].spec, self.scratch_slot, positions=self.rope)
        logits = self._run(name, x)
        Q = self.layouts[name].spec.q_per_req
        short = [(int(s), q - 1) for s, q in zip(batch.kda_slots, batch.q_lens) if q < Q]
        if short:                 # padded rows advanced these states: back to the last live row
            self.rollback_kda([s for s, _ in short], [p for _, p in short])
        return torch.as_tensor(logits, device=self.device)[rows.to(self.device)]

    def prefill(self, batch: Batch) -> torch.Tensor:
        ends = {i: sum(batch.q_lens[:i + 1]) - 1 for i in range(len(batch.q_lens))}
        wanted = {int(r): i for i, e in ends.items() for r in batch.logit_rows.tolist() if r == e}
        if len(wanted) != len(batch.logit_rows):
            raise ValueError("prefill engines give logits of a sequence's last token only; "
                             f"asked for rows {batch.logit_rows.tolist()}")
        for i, c in enumerate(batch.ctx_lens):
            if c == 0:                # the graph continues from the slot: a fresh sequence starts at zero
                self._zero_kda_slot(int(batch.kda_slots[i]))
        last = {}
        for piece in prefill_slices(batch, self.prefill_caps):
            name = f"prefill_t{piece.capacity}"
            logits = self._run(name, prefill_inputs(batch, piece, self.layouts[name].spec, positions=self.rope))
            if piece.last:
                last[piece.seq] = torch.as_tensor(logits, device=self.device)[0].clone()
        return torch.stack([last[wanted[int(r)]] for r in batch.logit_rows.tolist()]) if wanted else \
            torch.empty(0, self.cfg.vocab_size, device=self.device)

    def _zero_kda_slot(self, slot: int) -> None:
        for layer in self._kda_layers():
            for kind in ("kda_state", "kda_conv"):
                self.cuda.zero_row(self._cache(f"{kind}_{layer}"), slot)

    def copy_kda(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:        # in order: a later pair may read a slot an earlier one wrote
            for layer in self._kda_layers():
                for kind in ("kda_state", "kda_conv"):
                    buf = self._cache(f"{kind}_{layer}")
                    self.cuda.copy_row(buf, dst, buf, src)

    def rollback_kda(self, slots: list[int], positions: list[int]) -> None:
        for layer in self._kda_layers():
            for kind in ("state", "conv"):
                step = f"kda_step_{kind}_{layer}"
                if step not in self.caches:
                    raise RuntimeError("rollback_kda needs a verify engine with per-position KDA states")
                dst, src = self._cache(f"kda_{kind}_{layer}"), self._cache(step)
                for s, p in zip(slots, positions):
                    self.cuda.copy_row(dst, s, src, s, sub=p)
        self.cuda.synchronize()
