"""The vision encoder's per-capacity ONNX graphs (tiny preset): the I/O contract, onnxruntime
equivalence with the eager encoder on several images, and the engine dir recording the encoder
capacities (--encoder-capacities) with clear errors for the ones it cannot build."""

import onnx
import pytest
import torch

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from k3trt.builder.build import build_engine  # noqa: E402
from k3trt.builder.export_vision import check_encoder, export_encoder  # noqa: E402
from k3trt.engine.capacities import Capacities, CapacityError  # noqa: E402
from k3trt.engine.engine_dir import read_engine_dir  # noqa: E402
from k3trt.engine.vision_io import EncoderSpec, encoder_io_specs  # noqa: E402


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    cfg, model = tiny_model
    spec = EncoderSpec(128, torch.float32)
    return cfg, model, spec, export_encoder(model.vision, spec, tmp_path_factory.mktemp("enc") / f"{spec.name}.onnx")


def test_encoder_graph_follows_its_contract(exported):
    cfg, _, spec, path = exported
    graph = onnx.load(str(path), load_external_data=False).graph
    ins, outs = encoder_io_specs(cfg.vision, spec)
    assert [i.name for i in graph.input] == [t.name for t in ins]
    for value, t in zip([*graph.input, *graph.output], [*ins, *outs]):
        assert [d.dim_value for d in value.type.tensor_type.shape.dim] == list(t.shape), t.name
    assert [o.name for o in graph.output] == ["image_embeds"]


@pytest.mark.parametrize("seed", [1, 2])
def test_onnxruntime_matches_the_encoder(exported, seed):
    _, model, spec, path = exported
    assert check_encoder(path, model.vision, spec, seed=seed) < 1e-3


def test_engine_dir_records_encoder_capacities(tiny_ckpt, tmp_path):
    out = build_engine(tiny_ckpt, tmp_path / "e", dtype="fp32", capacities=[1, 2], max_num_tokens=32,
                       encoder_capacities=[64, 256])
    caps = read_engine_dir(out).capacities
    assert caps.encoder == (64, 256) and caps.pick_encoder(65) == 256
    with pytest.raises(CapacityError, match="exceed the largest capacity 256"):
        caps.pick_encoder(257)
    assert Capacities.from_dict(caps.to_dict()) == caps
    assert "encoder" not in Capacities((1,), (1,)).to_dict()          # text-only engines read as before


@pytest.mark.parametrize("kw, match", [
    (dict(encoder_capacities=[64, 130]), "not multiples of 4"),
    (dict(encoder_capacities=[64], backend="tensorrt"), "does not build the vision encoder"),
])
def test_encoder_capacity_errors(tiny_ckpt, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        build_engine(tiny_ckpt, tmp_path / "e", dtype="fp32", capacities=[1], max_num_tokens=32, **kw)


@pytest.mark.slow
def test_onnx_engine_dir_holds_checked_encoder_graphs(tiny_ckpt, tmp_path):
    out = build_engine(tiny_ckpt, tmp_path / "e", backend="onnx", dtype="fp32", capacities=[1], max_num_tokens=4,
                       spec_tokens=0, encoder_capacities=[64, 128], check_onnx=True)
    ed = read_engine_dir(out)
    assert ed.capacities.encoder == (64, 128)
    assert {"rank0/encoder_p64.onnx", "rank0/encoder_p128.onnx"} <= set(ed.files)
