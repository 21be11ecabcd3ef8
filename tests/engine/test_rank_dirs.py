"""Multi-rank torch engine dirs: `k3trt build --tp/--ep/--dcp` writes one rank{r}/ per rank holding
only that rank's slices (model/rank_checkpoint.py), config.json records the layout, and a rank's
model loaded from its rank dir equals the one the loader slices from the whole checkpoint. Tiny
preset with 4 KDA heads (so TP 2 and 4 divide every split), bf16 checkpoint loaded in fp32; the
tiny preset's own fp8 and mxfp4 checkpoints for the stored formats."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from k3trt.builder.build import build_engine
from k3trt.cli import main
from k3trt.config import ModelConfig
from k3trt.engine.engine_dir import EngineDirError, read_engine_dir
from k3trt.model.checkpoint_io import INDEX_NAME, CheckpointReader
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.loader import build_model, load_model
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.model.presets import preset_config
from k3trt.model.quant import fp8_block_encode, mxfp4_encode, read_linear_weight
from k3trt.model.rank_checkpoint import SHARD_KEY, slice_linear
from k3trt.model.weights import WeightError, checkpoint_tensors, init_random_, load_weights
from k3trt.parallel import Comm, ParallelConfig
from k3trt.parallel.shard import Part

SMALL = dict(dtype="fp32", capacities=[1, 2], max_num_tokens=32, spec_tokens=0, block_size=16)


@pytest.fixture(scope="module")
def variant_ckpt(tmp_path_factory):
    """The tiny preset with 4 KDA heads, as a real checkpoint (bf16 shards + index + config.json)."""
    raw = preset_config("tiny", vocab_size=512)
    raw["text_config"]["linear_attn_config"]["num_heads"] = 4
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg)
    init_random_(model, seed=5)
    out = tmp_path_factory.mktemp("variant") / "ckpt"
    write_checkpoint(out, checkpoint_tensors(model.to(torch.bfloat16), cfg), max_shard_bytes=1 << 20)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@pytest.fixture(scope="module")
def tp2ep2(variant_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2ep2") / "engine"
    res = CliRunner().invoke(main, ["build", str(variant_ckpt), "-o", str(out), "--backend", "torch", "--dtype", "fp32",
                                    "--tp", "2", "--ep", "2", "--capacities", "1,2", "--max-num-tokens", "32",
                                    "--spec-tokens", "0", "--block-size", "16"])
    assert res.exit_code == 0, res.output
    return out


def _rank_models(ckpt, ed):
    """For every rank: (pc, the model loaded from its rank dir, the model sliced from the checkpoint)."""
    cfg = ed.model
    for r in range(ed.world_size):
        pc = ed.parallel.with_rank(r)
        mine, sliced = build_model(cfg, comm=Comm(pc)), build_model(cfg, comm=Comm(pc))
        load_weights(mine, ed.rank_path(r), cfg, pc)
        load_weights(sliced, ckpt, cfg, pc)
        yield pc, mine, sliced


def test_build_writes_each_rank_only_its_slices(variant_ckpt, tp2ep2):
    ed = read_engine_dir(tp2ep2)
    assert (ed.parallel.tp, ed.parallel.dcp, ed.parallel.ep, ed.world_size) == (2, 1, 2, 2)
    assert json.loads((tp2ep2 / "config.json").read_text())["parallel"] == {"tp": 2, "dcp": 1, "ep": 2,
                                                                           "dcp_interleave": 1}
    assert sorted(p.name for p in tp2ep2.iterdir() if p.is_dir()) == ["rank0", "rank1", "tokenizer"]
    full = sum(f.stat().st_size for f in variant_ckpt.glob("*.safetensors"))
    q_b = "language_model.model.layers.2.self_attn.q_b_proj.weight"            # the MLA layer's heads
    with CheckpointReader(variant_ckpt) as reader:
        q_rows = reader.shape(q_b)[0]
    for r in range(2):
        rank = ed.rank_path(r)
        assert json.loads((rank / "config.json").read_text()) == ed.model_raw
        size = sum(f.stat().st_size for f in rank.glob("*.safetensors"))
        assert 0.3 * full < size < 0.7 * full, (r, size, full)
        with CheckpointReader(rank) as reader:
            assert reader.metadata[SHARD_KEY] == {"tp": 2, "dcp": 1, "ep": 2, "dcp_interleave": 1, "rank": r}
            experts = {int(n.split("experts.")[1].split(".")[0]) for n in reader.names() if ".experts." in n}
            assert experts == set(range(4 * r, 4 * r + 4))          # its expert range only, global numbers
            assert reader.shape(q_b)[0] == q_rows // 2
    for pc, mine, sliced in _rank_models(variant_ckpt, ed):
        whole = dict(sliced.named_parameters())
        for name, p in mine.named_parameters():
            assert torch.equal(p, whole[name]), (pc.rank, name)


def test_ranks_with_the_same_weights_share_their_files(variant_ckpt, tmp_path):
    """TP 2 x DCP 4: ranks 2 and 3 hold ranks 0 and 1's weights (DCP splits the cache): hard links
    inside the engine dir, each with its own index naming its rank."""
    ed = read_engine_dir(build_engine(variant_ckpt, tmp_path / "engine",
                                      parallel=ParallelConfig(tp=2, dcp=4, dcp_interleave=2), **SMALL))
    assert (ed.world_size, ed.parallel.dcp_interleave) == (4, 2)
    for r in (2, 3):
        for f in ed.rank_path(r - 2).glob("*.safetensors"):
            assert (ed.rank_path(r) / f.name).stat().st_ino == f.stat().st_ino
        with CheckpointReader(ed.rank_path(r)) as reader:
            assert reader.metadata[SHARD_KEY]["rank"] == r
    for pc, mine, sliced in _rank_models(variant_ckpt, ed):
        whole = dict(sliced.named_parameters())
        assert all(torch.equal(p, whole[n]) for n, p in mine.named_parameters()), pc.rank


@pytest.mark.parametrize("quant", ["fp8", "mxfp4"])
def test_quantized_checkpoints_split_equal_the_load_time_slices(quant, tmp_path):
    """mxfp4 experts stay packed in their EP rank's dir; fp8 projections cut off their 128-blocks
    are stored decoded (fp32): both load equal to the loader's own cut of the checkpoint."""
    ckpt = make_checkpoint("tiny", tmp_path / "ckpt", quant=quant)
    ed = read_engine_dir(build_engine(ckpt, tmp_path / "engine", parallel=ParallelConfig(tp=2, ep=2, dcp=2),
                                      **SMALL))
    for pc, mine, sliced in _rank_models(ckpt, ed):
        whole = dict(sliced.named_parameters())
        for name, p in mine.named_parameters():
            assert torch.equal(p, whole[name]), (pc.rank, name)
    with CheckpointReader(ed.rank_path(1)) as reader:
        if quant == "mxfp4":
            packed = [n for n in reader.names() if n.endswith(".weight_packed")]
            assert packed and all(reader.dtype(n) == torch.uint8 for n in packed)
            assert all(4 <= int(n.split("experts.")[1].split(".")[0]) < 8 for n in packed)
        else:
            assert any(reader.dtype(n) == torch.float8_e4m3fn for n in reader.names())   # replicated: as stored


def test_block_aligned_cuts_keep_the_stored_format(tmp_path):
    """A cut on fp8 128-blocks or mxfp4 32-groups is sliced in its stored form, one across a block
    is stored decoded (fp32); decoding either equals slicing the decoded weight."""
    g = torch.Generator().manual_seed(0)
    q8, s8 = fp8_block_encode(torch.randn(256, 512, generator=g))
    q6, s6 = fp8_block_encode(torch.randn(256, 384, generator=g))         # halves of 192 columns: across blocks
    p4, s4 = mxfp4_encode(torch.randn(6, 128, generator=g))
    write_checkpoint(tmp_path / "ckpt", {"a.weight": q8, "a.weight_scale_inv": s8, "c.weight": q6,
                                         "c.weight_scale_inv": s6, "b.weight_packed": p4, "b.weight_scale": s4},
                     max_shard_bytes=1 << 20)
    with CheckpointReader(tmp_path / "ckpt") as reader:
        for module, dim, fmt in (("a", 0, torch.float8_e4m3fn), ("a", 1, torch.float8_e4m3fn),
                                 ("c", 1, torch.float32), ("b", 0, torch.uint8), ("b", 1, torch.uint8)):
            full = read_linear_weight(reader, module).dequantize(torch.float32)
            for i in range(2):
                part = Part(dim, i, 2)
                cut = slice_linear(reader, module, part)
                assert next(iter(cut.values())).dtype == fmt, (module, dim)
                out = tmp_path / f"{module}{dim}{i}"
                write_checkpoint(out, cut, max_shard_bytes=1 << 20)
                with CheckpointReader(out) as back:
                    got = read_linear_weight(back, module).dequantize(torch.float32)
                assert torch.equal(got, part.take(full)), (module, dim, i)


def test_bad_layouts_are_refused_before_any_work_naming_the_field(variant_ckpt, tiny_ckpt, tmp_path):
    out = tmp_path / "engine"
    for ckpt, args, words in ((tiny_ckpt, ["--tp", "4"], ["--tp", "linear_attn_config.num_heads=2"]),
                              (variant_ckpt, ["--tp", "3"], ["--tp", "num_attention_heads=4"]),
                              (variant_ckpt, ["--ep", "3"], ["--ep", "num_experts=8"]),
                              (variant_ckpt, ["--dcp", "2", "--dcp-interleave", "3"], ["--dcp-interleave 3",
                                                                                      "--block-size 64"]),
                              (variant_ckpt, ["--tp", "2", "--backend", "onnx"], ["--backend onnx", "--backend torch"])):
        res = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--backend", "torch", "--dtype", "fp32",
                                        *args])
        assert res.exit_code != 0 and all(w in res.output for w in words), (args, res.output)
        assert not out.exists()


def test_engine_dir_reads_and_verifies_rank_dirs(tp2ep2, variant_ckpt, tmp_path):
    ed = read_engine_dir(tp2ep2, verify_checksums=False)
    assert ed.rank_path(1) == tp2ep2 / "rank1" and ed.rank_dir == tp2ep2 / "rank0"
    with pytest.raises(EngineDirError, match="no rank 2"):
        ed.rank_path(2)
    with pytest.raises(EngineDirError, match=r"--tp 4: .*tp=2 dcp=1 ep=2"):
        ed.layout(tp=4, ep=2)
    assert ed.layout(tp=2, dcp=None, ep=2) == ed.layout() == ed.parallel

    copy = tmp_path / "engine"
    shutil.copytree(tp2ep2, copy)
    shard = sorted((copy / "rank1").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    read_engine_dir(copy, rank=0)                     # rank 0 verifies the shared files and its own only
    for kw in ({}, {"rank": 1}):
        with pytest.raises(EngineDirError, match=r"checksum of rank1/"):
            read_engine_dir(copy, **kw)
    shutil.rmtree(copy / "rank1")
    with pytest.raises(EngineDirError, match="rank1/.* missing"):
        read_engine_dir(copy, rank=0)
    # a rank reads only its files: rank 0's model loads with rank 1's dir gone
    cfg = ed.model
    pc = ed.parallel.with_rank(0)
    model = build_model(cfg, comm=Comm(pc))
    load_weights(model, copy / "rank0", cfg, pc)


def test_loader_refuses_a_rank_dir_of_another_shard(tp2ep2):
    ed = read_engine_dir(tp2ep2, verify_checksums=False)
    with pytest.raises(WeightError, match="rank 1's slices .* one process"):
        load_model(ed.rank_path(1))
    pc = ed.parallel.with_rank(0)
    with pytest.raises(WeightError, match="rank 1's slices"):
        load_weights(build_model(ed.model, comm=Comm(pc)), ed.rank_path(1), ed.model, pc)


def test_damaged_rank_index_or_config_is_refused(tp2ep2, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tp2ep2, copy)
    index = copy / "rank1" / INDEX_NAME
    index.write_text(index.read_text().replace('"rank": 1', '"rank": 0'))
    with pytest.raises(EngineDirError, match=f"checksum of rank1/{INDEX_NAME}"):
        read_engine_dir(copy)
    cfg = copy / "config.json"
    doc = json.loads(cfg.read_text())
    doc["parallel"]["tp"] = 4
    cfg.write_text(json.dumps(doc))
    with pytest.raises(EngineDirError, match="edited after the build"):
        read_engine_dir(copy)


def test_cli_rank_options(tp2ep2, monkeypatch):
    runner = CliRunner()
    for cmd in ("run", "serve", "triton-repo", "triton-serve"):
        res = runner.invoke(main, [cmd, "--help"])
        assert all(o in res.output for o in ("--tp", "--dcp", "--ep", "--rank-timeout")), (cmd, res.output)
    res = runner.invoke(main, ["run", str(tp2ep2), "-p", "hi", "--tp", "4"])
    assert res.exit_code != 0 and "--tp 4" in res.output and "tp=2 dcp=1 ep=2" in res.output
    res = runner.invoke(main, ["triton-repo", str(tp2ep2), "-o", "unused", "--ep", "1"])
    assert res.exit_code != 0 and "--ep 1" in res.output
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    res = runner.invoke(main, ["run", str(tp2ep2), "-p", "hi"])
    assert res.exit_code != 0 and "torchrun started 4 processes" in res.output and "runs on 2" in res.output


def test_triton_repository_for_a_two_rank_engine(tp2ep2, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["triton-repo", str(tp2ep2), "-o", str(tmp_path / "repo"), "--device", "cuda",
                               "--rank-timeout", "60"])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "repo" / "k3" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1 kind: KIND_MODEL } ]" in text
    assert '\\"rank_timeout_s\\": 60.0' in text
    res = runner.invoke(main, ["triton-repo", str(tp2ep2), "-o", str(tmp_path / "cpu"), "--device", "cpu"])
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in (tmp_path / "cpu" / "k3" / "config.pbtxt").read_text()
    res = runner.invoke(main, ["triton-repo", str(tp2ep2), "-o", str(tmp_path / "two"), "--instances", "2"])
    assert res.exit_code != 0 and "one instance" in res.output and "2 ranks" in res.output


def test_an_unsplit_engine_runs_the_layout_the_options_ask_for(tp2ep2, engine):
    """The CLI and LLM decide the layout in one place (EngineDir.layout): an engine dir built
    unsplit takes --tp/--dcp/--ep as asked (the loader slices the checkpoint), a split one its own."""
    from k3trt.cli import _rank_engine_options  # noqa: PLC0415 (the CLI's mapping of the flags)
    from k3trt.parallel.config import ParallelConfig  # noqa: PLC0415
    from k3trt.runtime.rank_session import parallel_config  # noqa: PLC0415
    assert _rank_engine_options(engine, 2, None, None, 30.0) == {"tp": 2, "rank_timeout_s": 30.0}
    assert _rank_engine_options(engine, None, None, None, 30.0) == {}
    assert _rank_engine_options(tp2ep2, 2, None, 2, 30.0) == {"rank_timeout_s": 30.0}
    ed = read_engine_dir(engine, verify_checksums=False)
    assert parallel_config(ed, tp=2, dcp=None, ep=2, dcp_interleave=None) == ParallelConfig(tp=2, ep=2)
    assert ed.layout(dcp=2) == ParallelConfig(dcp=2)
