"""The onnx engine backend's session: the per-capacity graphs of an engine dir (``verify_b{B}.onnx``,
``prefill_t{T}.onnx``, weights shared in ``weights.bin``: the very graphs the TensorRT backends
build their engines from) run by onnxruntime on the CPU, the k3trt nodes as onnxruntime custom
ops (plugins/onnx_ort.py: each runs its op's torch reference).

It executes the engine I/O contract end to end where no TensorRT-family GPU is at hand: the
step staging, padding, prefill slices and KDA rollback are CapacitySession's
(runtime/engine_io.py), shared with the TensorRT session. The graphs are functional, so each run
hands back every cache it writes as ``<name>_out``, which replaces the session's tensor: no double
buffers, one host copy per cache. fp32 only (the custom ops are registered for fp32).

Images: an engine dir built with ``--encoder-capacities`` holds the encoder graphs
(``encoder_p{P}.onnx``, engine/vision_io.py) and prefill graphs that take image embeddings;
``encode_images`` runs a step's images through them (consecutive images per call as the largest
capacity holds, padded to the smallest that holds them, the padding rows sliced off), and an
image with more patches than the largest capacity is refused at submission (``max_image_patches``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from k3trt.config import ModelConfig
from k3trt.engine.capacities import Capacities, pick
from k3trt.engine.graph_io import GraphSpec, graph_specs, io_specs, uses_rope
from k3trt.engine.vision_io import ENCODER_INPUTS, encoder_specs
from k3trt.runtime.engine_io import CapacitySession, cache_bindings

log = logging.getLogger(__name__)


class OnnxSession(CapacitySession):
    """The graphs of one rank dir in onnxruntime on the CPU. `verify`/`prefill`: the capacities
    this run uses (a subset of the built ones), `spec_tokens`: the build's K (the verify graphs
    run K + 1 rows per request); `plan` is the runtime's CachePlan, one KDA slot is added past
    plan.num_slots as the scratch slot of padded verify requests; `encoder`: the build's encoder
    patch capacities (image prompts: the module doc)."""

    def __init__(self, rank_dir: str | Path, cfg: ModelConfig, plan, *, verify: tuple[int, ...],
                 prefill: tuple[int, ...], spec_tokens: int, max_seq_len: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, kv_scale: float = 1.0, threads: int = 0, encoder: tuple[int, ...] = ()):
        if dtype != torch.float32 or kv_dtype != torch.float32:
            raise ValueError(f"the onnx engine backend runs fp32 graphs (its custom ops are fp32); this engine "
                             f"dir is {dtype} with a {kv_dtype} cache: rebuild it with --backend onnx --dtype fp32")
        from k3trt.plugins.onnx_ort import ort_session  # noqa: PLC0415 (optional: onnxruntime)

        t0 = time.perf_counter()
        rank_dir = Path(rank_dir)
        self.cfg, self.plan, self.device = cfg, plan, torch.device("cpu")
        self.scratch_slot = plan.num_slots
        self.verify_caps, self.prefill_caps = tuple(verify), tuple(prefill)
        self.rope = uses_rope(cfg)
        specs = graph_specs(cfg, Capacities(self.verify_caps, self.prefill_caps, spec_tokens, tuple(encoder)),
                            block_size=plan.block_size, max_seq_len=max_seq_len, dtype=dtype, kv_dtype=kv_dtype,
                            kv_scale=kv_scale)
        self.specs: dict[str, GraphSpec] = {s.name: s for s in specs}
        self.sessions = {}
        for spec in specs:
            path = rank_dir / f"{spec.name}.onnx"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: the engine dir was not built for capacity {spec.name} "
                                        "(rebuild it with `k3trt build ... --backend onnx`)")
            self.sessions[spec.name] = ort_session(path, threads=threads)
            self._check_io(spec, self.sessions[spec.name])
        self.encoders = {}
        for spec in encoder_specs(cfg.vision, encoder, dtype) if encoder and cfg.vision is not None else ():
            path = rank_dir / f"{spec.name}.onnx"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: the engine dir records encoder capacity {spec.capacity} "
                                        "but not its graph (rebuild it with `k3trt build ... --backend onnx`)")
            self.encoders[spec.capacity] = ort_session(path, threads=threads)
        self.takes_embeds = bool(self.encoders)
        self.max_image_patches = max(self.encoders) if self.encoders else None
        dims = {"num_blocks": plan.num_blocks, "num_slots": plan.num_slots + 1}
        self.caches = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in cache_bindings(cfg, specs, dims).items()}
        self.cache_names = frozenset(self.caches)
        log.info("onnx session: %d step graphs and %d encoder graphs from %s in %.1fs, caches %.1f MiB",
                 len(self.sessions), len(self.encoders), rank_dir, time.perf_counter() - t0,
                 sum(c.nbytes for c in self.caches.values()) / 2**20)

    def _check_io(self, spec: GraphSpec, sess) -> None:
        """The graph binds exactly the contract's names (engine/graph_io.py: io_specs), in order."""
        ins, outs = io_specs(self.cfg, spec)
        got = ([i.name for i in sess.get_inputs()], [o.name for o in sess.get_outputs()])
        if got != ([t.name for t in ins], [t.name for t in outs]):
            raise RuntimeError(f"{spec.name}.onnx: its inputs/outputs differ from the engine contract (built by "
                               "another k3trt?); rebuild the engine dir with `k3trt build ... --backend onnx`")

    def close(self) -> None:
        """Drop the onnxruntime sessions and the caches; the session is unusable afterwards."""
        self.sessions, self.caches, self.encoders = {}, {}, {}

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        if not self.encoders:
            return super().encode_images(pixel_values, grid_thws)
        grids = [tuple(g) for g in grid_thws.tolist()]
        calls, patches = [[]], 0
        for t, h, w in grids:         # consecutive images, as many per call as the largest graph holds
            if calls[-1] and patches + t * h * w > self.max_image_patches:
                calls.append([])
                patches = 0
            calls[-1].append((t, h, w))
            patches += t * h * w
        out, at = [], 0
        for call in calls:
            n = sum(t * h * w for t, h, w in call)
            out.append(self._encode(pixel_values[at:at + n], call))
            at += n
        return torch.cat(out)

    def _encode(self, pixels: torch.Tensor, grids: list) -> torch.Tensor:
        from k3trt.model.vision import vision_batch  # noqa: PLC0415 (the tower's module: image engines only)

        cap = pick(sorted(self.encoders), pixels.shape[0], "encoder")
        batch = vision_batch(self.cfg.vision, grids, capacity=cap)
        padded = torch.zeros(cap, *pixels.shape[1:], dtype=torch.float32)
        padded[:len(pixels)] = pixels
        feed = {"pixel_values": padded.numpy(), **{k: getattr(batch, k).contiguous().numpy() for k in ENCODER_INPUTS[1:]}}
        return torch.from_numpy(self.encoders[cap].run(["image_embeds"], feed)[0][:batch.num_tokens])

    # -- CapacitySession primitives
    def _run(self, name: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        sess = self.sessions[name]
        feed = {k: v.contiguous().numpy() for k, v in inputs.items()}
        feed.update({i.name: self.caches[i.name].numpy() for i in sess.get_inputs() if i.name in self.caches})
        names = [o.name for o in sess.get_outputs()]
        outs = dict(zip(names, sess.run(names, feed)))
        for out_name, value in outs.items():
            if out_name != "logits":
                self.caches[out_name[:-len("_out")]] = torch.from_numpy(value)
        return torch.from_numpy(outs["logits"])

    def _zero_row(self, cache: str, row: int) -> None:
        self.caches[cache][row].zero_()

    def _copy_row(self, dst: str, drow: int, src: str, srow: int, sub: int | None = None) -> None:
        s = self.caches[src][srow]
        self.caches[dst][drow].copy_(s if sub is None else s[sub])
