"""Export the vision encoder to ONNX, one static graph per encoder patch capacity, and check each
with onnxruntime against the eager encoder (k3trt/engine/vision_io.py is the graph contract).

The graph is ``VisionEncoder.encode(attention="masked")`` over a padded batch: attention is one SDPA
under a same-image mask, so the graph has no data-dependent shapes and any mix of image sizes up
to the capacity runs in it. Standard ONNX ops only (no k3trt plugin nodes).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from k3trt.engine.vision_io import ENCODER_INPUTS, EncoderSpec, encoder_io_specs
from k3trt.model.vision import VisionBatch, VisionEncoder, vision_batch
from k3trt.testing import assert_close
from k3trt.vision_config import VisionConfig

log = logging.getLogger(__name__)


class EncoderGraph(nn.Module):
    """The encoder over one capacity, inputs as ENCODER_INPUTS names them."""

    def __init__(self, encoder: VisionEncoder, spec: EncoderSpec):
        super().__init__()
        self.encoder, self.spec = encoder, spec

    def forward(self, *inputs: Tensor) -> Tensor:
        x = dict(zip(ENCODER_INPUTS, inputs))
        area = self.encoder.cfg.merge_area
        batch = VisionBatch(grids=(), pos_index=x["pos_index"], pos_weight=x["pos_weight"], frame=x["frame"],
                            rope_pos=x["rope_pos"], segment=x["segment"], merge_dest=x["merge_dest"],
                            merge_weight=x["merge_weight"], num_patches=self.spec.capacity,
                            num_tokens=self.spec.capacity // area)
        return self.encoder.encode(x["pixel_values"], batch, attention="masked")


def example_grids(vcfg: VisionConfig, capacity: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """Random image grids (multiples of the merge kernel) that together fit `capacity` patches:
    several images of different sizes, so the check covers the block-diagonal attention."""
    g = torch.Generator().manual_seed(seed)
    kh, kw = vcfg.merge_kernel_size
    grids, used = [], 0
    while True:
        side = max(1, int((capacity / 4) ** 0.5) // max(kh, kw))
        h = kh * int(torch.randint(1, side + 1, (1,), generator=g))
        w = kw * int(torch.randint(1, side + 1, (1,), generator=g))
        if used + h * w > capacity or len(grids) == 3:
            break
        grids.append((1, h, w))
        used += h * w
    return grids or [(1, kh, kw)]


def example_inputs(vcfg: VisionConfig, spec: EncoderSpec, seed: int = 0) -> tuple[dict[str, Tensor], int]:
    """(graph inputs for random images filling part of the capacity, their token count)."""
    batch = vision_batch(vcfg, example_grids(vcfg, spec.capacity, seed), capacity=spec.capacity)
    g = torch.Generator().manual_seed(seed)
    p = vcfg.patch_size
    pixels = torch.zeros(spec.capacity, 3, p, p)
    pixels[: batch.num_patches] = torch.randn(batch.num_patches, 3, p, p, generator=g)
    values = {"pixel_values": pixels.to(spec.dtype), **{n: getattr(batch, n) for n in ENCODER_INPUTS[1:]}}
    return values, batch.num_tokens


def export_encoder(encoder: VisionEncoder, spec: EncoderSpec, path: str | Path) -> Path:
    """Export one capacity's encoder graph to `path` (weights in ``<path>.data``); onnx.checker runs."""
    import onnx  # noqa: PLC0415 (optional: onnx)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vcfg = encoder.cfg
    inputs, _ = example_inputs(vcfg, spec)
    ins, outs = encoder_io_specs(vcfg, spec)
    t0 = time.perf_counter()
    log.info("export %s: tracing", spec.name)
    with torch.no_grad():
        exported = torch.export.export(EncoderGraph(encoder, spec).eval(), tuple(inputs.values()), strict=False)
    quiet = ("onnxscript", "onnx_ir")
    saved = {name: logging.getLogger(name).level for name in quiet}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        program = torch.onnx.export(exported, dynamo=True, external_data=True, input_names=[t.name for t in ins],
                                    output_names=[t.name for t in outs], optimize=True, verbose=False)
        program.save(str(path), external_data=True)
    finally:
        for name, lvl in saved.items():
            logging.getLogger(name).setLevel(lvl)
    onnx.checker.check_model(str(path), full_check=False)
    log.info("export %s: %s written and checked in %.1fs", spec.name, path.name, time.perf_counter() - t0)
    return path


def check_encoder(onnx_path: str | Path, encoder: VisionEncoder, spec: EncoderSpec, *, seed: int = 1,
                  atol: float = 2e-4, rtol: float = 2e-3) -> float:
    """Run the graph in onnxruntime on random images filling part of the capacity and compare
    their tokens with the eager encoder (per image, unpadded). Returns the worst |error|."""
    import onnxruntime as ort  # noqa: PLC0415 (optional: onnxruntime)

    vcfg = encoder.cfg
    inputs, tokens = example_inputs(vcfg, spec, seed)
    grids = example_grids(vcfg, spec.capacity, seed)
    patches = sum(t * h * w for t, h, w in grids)
    with torch.no_grad():
        ref = encoder(inputs["pixel_values"][:patches], torch.tensor(grids))
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {k: v.numpy() for k, v in inputs.items()})[0])
    assert_close(got[:tokens], ref, dtype=torch.float32, atol=atol, rtol=rtol, name=f"{Path(onnx_path).name}")
    err = float((got[:tokens].double() - ref.double()).abs().max())
    log.info("onnxruntime check %s: %d images, %d tokens match (worst %.2g)", Path(onnx_path).name, len(grids),
             tokens, err)
    return err
