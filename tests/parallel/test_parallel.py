"""Tensor, expert and decode-context parallelism on CPU: gloo processes on 127.0.0.1 must give the
greedy tokens (and, within fp32 reordering error, the logits) of one process, over chunked
prefill, decode, verification with KDA rollback and the MTP layer (k3trt/parallel/check.py).

The tiny preset has 2 KDA heads; the runs use a variant with 4 (so TP 4 divides every split),
written as a real checkpoint, so every rank also goes through the sharded loader. The loader is
checked separately on the tiny preset's own checkpoint.
"""

import json
import os

import pytest
import torch

from k3trt.config import ModelConfig
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.loader import build_model, load_model
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.model.presets import preset_config
from k3trt.model.weights import checkpoint_tensors, init_random_, load_weights
from k3trt.parallel import SINGLE, Comm, ParallelConfig, ParallelConfigError, launch
from k3trt.parallel.cache import dcp_slot_mapping
from k3trt.parallel.check import compare, greedy_trace, load_trace, make_prompts, worker
from k3trt.parallel.shard import ShardError, param_part

# Layouts per world size; each world is one spawn that runs its layouts in turn.
LAYOUTS = {
    2: [dict(tp=2), dict(dcp=2), dict(dcp=2, dcp_interleave=4), dict(ep=2),
        dict(tp=2, dcp=2, ep=2, dcp_interleave=2)],
    4: [dict(dcp=4), dict(tp=2, dcp=4, ep=2), dict(tp=4, dcp=4, ep=4, dcp_interleave=2),
        dict(tp=4, dcp=2, ep=4)],
}
CASES = [(w, i) for w, layouts in LAYOUTS.items() for i in range(len(layouts))]
# fp32: only the order of the sums changes (measured worst logit difference ~1e-5 of |logit| <= 4)
TOL = dict(atol=5e-5, rtol=1e-4, rel_norm=1e-5)


def variant_config() -> dict:
    raw = preset_config("tiny", vocab_size=512)
    raw["text_config"]["linear_attn_config"]["num_heads"] = 4
    return raw


@pytest.fixture(scope="module")
def variant_ckpt(tmp_path_factory):
    """A real checkpoint (safetensors shards + index + config.json) of the 4-KDA-head variant."""
    raw = variant_config()
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg)
    init_random_(model, seed=3)
    out = tmp_path_factory.mktemp("variant")
    write_checkpoint(out, checkpoint_tensors(model.to(torch.bfloat16), cfg), max_shard_bytes=1 << 20)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@pytest.fixture(scope="module")
def reference(variant_ckpt):
    cfg, model = load_model(variant_ckpt)
    return greedy_trace(model, SINGLE, make_prompts(cfg.vocab_size))


def _rank(rank, ckpt, layouts, out_dir):
    """A rank of the test's spawn: records the multicast switches it sees, then runs the check."""
    (out_dir / f"env.rank{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in launch.MULTICAST_OFF}))
    torch.set_num_threads(1)
    worker(rank, str(ckpt), layouts, str(out_dir))


@pytest.fixture(scope="module")
def runs(variant_ckpt, tmp_path_factory):
    """world size -> its output directory, spawned on first use."""
    done = {}

    def get(world):
        if world not in done:
            out = tmp_path_factory.mktemp(f"world{world}")
            launch.spawn(_rank, world, variant_ckpt, LAYOUTS[world], out, backend="gloo")
            done[world] = out
        return done[world]
    return get


@pytest.mark.parametrize("world,i", CASES, ids=[",".join(f"{k}{v}" for k, v in LAYOUTS[w][i].items())
                                                 for w, i in CASES])
def test_parallel_equals_single_process(runs, reference, world, i):
    out = runs(world)
    for rank in range(world):
        got = load_trace(out / f"{i}.rank{rank}.pt")
        compare(got, reference, **TOL, name=f"{LAYOUTS[world][i]} rank {rank}")
    assert sum(len(t) for t in reference.tokens) == 13


def test_spawned_ranks_run_without_multicast(runs):
    out = runs(2)
    for rank in range(2):
        assert json.loads((out / f"env.rank{rank}.json").read_text()) == launch.MULTICAST_OFF


@pytest.mark.parametrize("layout", [dict(tp=2, ep=2), dict(tp=2, dcp=2, ep=2)])
def test_loader_gives_each_rank_its_slice(tiny_ckpt, tiny_model, layout):
    """Load every rank's shard of the real tiny checkpoint (no process group: loading needs none)
    and compare with the slices of the whole model; the expert ranges cover every expert once."""
    cfg, full = tiny_model
    whole = dict(full.named_parameters())
    experts = {}
    for rank in range(ParallelConfig(**layout).world_size):
        pc = ParallelConfig(**layout, rank=rank)
        model = build_model(cfg, comm=Comm(pc))
        load_weights(model, tiny_ckpt, cfg, pc)          # strict: every tensor consumed by some rule
        for name, p in model.named_parameters():
            part = param_part(name, pc)
            assert torch.equal(p, part.take(whole[name])), (rank, name)
            if part.dim is not None:
                assert p.shape[part.dim] * part.count == whole[name].shape[part.dim], name
            if name.endswith("experts.w_gate"):
                experts.setdefault(name, []).append(p)
        assert model.lm_head.weight.shape[0] == cfg.vocab_size // pc.tp
        assert model.model.layers[1].self_attn.num_heads == cfg.linear_attn_config.num_heads // pc.tp
    for name, parts in experts.items():
        assert torch.equal(torch.cat(parts), whole[name]), name


def test_loader_shards_a_quantized_checkpoint(tmp_path):
    """mxfp4 experts (K3's format): another EP rank's packed tensors are consumed unread."""
    ckpt = make_checkpoint("tiny", tmp_path / "mxfp4", quant="mxfp4")
    cfg, full = load_model(ckpt)
    whole = dict(full.named_parameters())
    for rank in range(2):
        pc = ParallelConfig(tp=2, ep=2, rank=rank)
        model = build_model(cfg, comm=Comm(pc))
        load_weights(model, ckpt, cfg, pc)
        for name, p in model.named_parameters():
            assert torch.equal(p, param_part(name, pc).take(whole[name])), (rank, name)


def test_shard_table_refuses_unplaced_parameters():
    with pytest.raises(ShardError, match="matches no rule"):
        param_part("model.layers.0.self_attn.new_proj.weight", ParallelConfig(tp=2))


def test_parallel_config_errors_name_the_fields(tiny_model):
    cfg, _ = tiny_model
    with pytest.raises(ParallelConfigError, match=r"tp=8 does not divide text_config.num_attention_heads=4"):
        ParallelConfig(tp=8).validate(cfg)
    with pytest.raises(ParallelConfigError, match=r"linear_attn_config.num_heads=2"):
        ParallelConfig(tp=4).validate(cfg)
    with pytest.raises(ParallelConfigError, match=r"ep=16 does not divide text_config.num_experts=8"):
        ParallelConfig(ep=16).validate(cfg)
    with pytest.raises(ParallelConfigError, match=r"tp=2 does not divide the world size 3"):
        ParallelConfig(tp=2, dcp=3)
    with pytest.raises(ParallelConfigError, match=r"rank=4 is outside 0..3"):
        ParallelConfig(dcp=4, rank=4)
    with pytest.raises(ParallelConfigError, match=r"dcp_interleave must be a positive integer"):
        ParallelConfig(dcp=2, dcp_interleave=0)
    ParallelConfig(tp=2, dcp=2, ep=2).validate(cfg)


def test_groups_are_contiguous_blocks():
    pc = ParallelConfig(tp=4, dcp=2, ep=4, rank=3)
    assert (pc.tp_rank, pc.dcp_rank, pc.ep_rank) == (3, 1, 3)
    assert pc.group_ranks("dcp") == (2, 3) and pc.all_groups("dcp") == [(0, 1), (2, 3)]
    assert ParallelConfig(tp=2, dcp=4, rank=2).group_ranks("tp") == (2, 3)


def test_single_process_comm_is_a_noop_and_refuses_real_groups():
    x = torch.randn(3, 4)
    assert SINGLE.all_reduce(x, "tp") is x and SINGLE.all_gather(x, "dcp", dim=1) is x
    with pytest.raises(RuntimeError, match="needs a TorchComm"):
        Comm(ParallelConfig(tp=2)).all_reduce(x, "tp")
    assert Comm(ParallelConfig(tp=2)).all_reduce(x, "ep") is x      # a group of one rank


@pytest.mark.parametrize("D,I", [(2, 1), (4, 2), (3, 4)])
def test_dcp_slot_mapping_writes_every_token_once_densely(D, I):
    """Over the D ranks each new token gets exactly one row, on rank (t // I) % D, and each rank's
    rows for a sequence are its local indices 0, 1, 2, ... laid over that sequence's pages."""
    ctx_lens, q_lens, bs, width = (0, 5), (37, 30), 16, 4
    table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
    hits = torch.zeros(sum(q_lens), dtype=torch.long)
    for r in range(D):
        pc = ParallelConfig(dcp=D, dcp_interleave=I, rank=r)
        slots = dcp_slot_mapping(ctx_lens, q_lens, table, bs, pc)
        hits += slots >= 0
        for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
            s = slots[sum(q_lens[:i]):sum(q_lens[:i + 1])]
            t = torch.arange(c, c + n)
            assert torch.equal(s >= 0, (t // I) % D == r)
            local = s[s >= 0] - i * width * bs
            start = (c // (D * I)) * I + min(max(c % (D * I) - r * I, 0), I)   # spec's local length
            assert torch.equal(local, torch.arange(start, start + local.numel())), (r, i)
    assert torch.equal(hits, torch.ones_like(hits))
