"""A Kimi-Linear checkpoint written by transformers' save_pretrained loads unchanged, and k3trt's
logits match transformers' in fp32: a prompt, decode steps through the caches, a 4-row verify step;
greedy tokens equal generate's."""

import json

import pytest
import torch
from click.testing import CliRunner
from hf_utils import hf_logits, hf_model, save
from model_utils import BLOCK, num_blocks, step_ctx

from k3trt.cli import main
from k3trt.model.checkpoint_io import CheckpointReader
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.context import ModelCache
from k3trt.model.loader import load_model
from k3trt.model.make_checkpoint import quant_config
from k3trt.model.quant import load_linear_weight, quantize_for_checkpoint
from k3trt.model.weights import QUANT_TARGETS, checkpoint_tensors
from k3trt.runtime.tokenizer import Tokenizer, k3_vocab_size, write_k3_tokenizer
from k3trt.testing import rel_norm_error

REL = 1e-4
VARIANTS = {"q_lora-grouped": {"q_lora": True, "grouped": True}, "no_q_lora-ungrouped": {"q_lora": False, "grouped": False}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = hf_model(**VARIANTS[request.param])
    d = tmp_path_factory.mktemp("hf") / request.param
    save(hf, d)
    cfg, model = load_model(d, dtype=torch.float32)
    return hf, cfg, model, d


def _steps(cfg, model, ids, plan):
    """Run `ids` through k3trt in steps of the sizes in `plan` over one cache; logits of every
    position. A step of 4 tokens after the prompt is a verify step (absorbed MLA, per-position KDA
    states kept)."""
    cache = ModelCache.allocate(cfg, num_blocks=num_blocks(1), block_size=BLOCK, num_slots=1, max_q=4)
    out, done = [], 0
    with torch.no_grad():
        for q in plan:
            ctx = step_ctx([q], [done], save_kda_states=(q == 4 and done > 0))
            out.append(model.logits(model(ids[done:done + q], ctx, cache)))
            done += q
    return torch.cat(out)


def test_config_reads_transformers_style(pair):
    hf, cfg, _, _ = pair
    c = hf.config
    assert cfg.kda_layers == tuple(i for i, t in enumerate(c.layer_types) if t == "linear_attention")
    assert cfg.first_k_dense_replace == 1 and cfg.mla_use_nope
    assert cfg.max_position_embeddings == c.max_position_embeddings
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_expert_group) == (8, 2, c.n_group)
    assert not cfg.linear_attn_config.use_full_rank_gate
    assert cfg.linear_attn_config.num_heads == 4 and cfg.linear_attn_config.head_dim == 16


def test_prompt_decode_and_verify_match_transformers(pair):
    hf, cfg, model, _ = pair
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size, (20,), generator=g)
    ref = hf_logits(hf, ids)
    # prompt of 13, three decode steps, one 4-row verify step
    got = _steps(cfg, model, ids, [13, 1, 1, 1, 4])
    for name, sl in (("prompt", slice(0, 13)), ("decode", slice(13, 16)), ("verify", slice(16, 20))):
        err = rel_norm_error(got[sl], ref[sl])
        assert err <= REL, (name, err)


def test_greedy_tokens_equal_generate(pair):
    hf, cfg, model, _ = pair
    prompt = torch.tensor([5, 17, 33, 8, 99, 41, 7])
    n = 8
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    cache = ModelCache.allocate(cfg, num_blocks=num_blocks(1), block_size=BLOCK, num_slots=1)
    got, ids, done = [], prompt, 0
    with torch.no_grad():
        for _ in range(n):
            logits = model.logits(model(ids, step_ctx([len(ids)], [done]), cache))
            done += len(ids)
            ids = logits[-1:].argmax(-1)
            got.append(int(ids))
    assert got == want


def test_build_and_run_cli_on_transformers_checkpoint(tmp_path):
    """`k3trt build` and `k3trt run`, the two documented commands, on save_pretrained's output with
    a tokenizer beside it; run's greedy tokens equal generate's."""


    hf = hf_model(vocab_size=k3_vocab_size(), layers=2)
    d = tmp_path / "kimi-linear"
    save(hf, d)
    write_k3_tokenizer(d)
    res = CliRunner().invoke(main, ["build", str(d), "-o", str(tmp_path / "engine"), "--backend", "torch",
                                    "--dtype", "fp32"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["run", str(tmp_path / "engine"), "-p", "The capital of France is",
                                    "--max-tokens", "6", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    prompt = torch.tensor(Tokenizer.from_dir(d).encode("The capital of France is"))
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=6, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == want, out


@pytest.mark.parametrize("quant, suffix", [("fp8", "weight_scale_inv"), ("mxfp4", "weight_packed")])
def test_quantized_published_layout_matches_dequantized_reference(tmp_path, quant, suffix):
    """block-fp8 projections / compressed-tensors mxfp4 experts under the published names load, and
    k3trt's logits match transformers' on the dequantized weights."""
    from transformers import KimiLinearForCausalLM  # noqa: PLC0415 (optional: transformers)


    plain, qdir, ddir = tmp_path / "plain", tmp_path / "q", tmp_path / "deq"
    save(hf_model(), plain)
    with CheckpointReader(plain) as r:
        tensors = {n: r.get(n).clone() for n in r.names()}
    q = {}
    for n, t in tensors.items():
        fmt = QUANT_TARGETS[quant](n, t.shape)
        q.update(quantize_for_checkpoint(n, t, fmt) if fmt != "none" else {n: t})
    assert any(n.endswith(suffix) for n in q)
    raw = json.loads((plain / "config.json").read_text())
    write_checkpoint(qdir, q, max_shard_bytes=1 << 20)
    (qdir / "config.json").write_text(json.dumps({**raw, "quantization_config": quant_config(quant)}))
    with CheckpointReader(qdir) as r:
        deq = {n: (load_linear_weight(r, n.removesuffix(".weight"), out_dtype=torch.float32)
                   if n.endswith(".weight") and t.dim() == 2 else t) for n, t in tensors.items()}
    write_checkpoint(ddir, deq, max_shard_bytes=1 << 20)
    (ddir / "config.json").write_text(json.dumps(raw))
    ref = KimiLinearForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    cfg, model = load_model(qdir, dtype=torch.float32)
    ids = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    got = _steps(cfg, model, ids, [8, 4])
    assert rel_norm_error(got, hf_logits(ref, ids)) <= REL
    assert rel_norm_error(got, hf_logits(hf_model(), ids)) > REL       # the weights really were quantized


def test_k3trt_written_checkpoint_loads_in_transformers(pair, tmp_path):
    """The inverse: k3trt's writer (make-checkpoint's) gives names, shapes and a released-style
    config.json that transformers' kimi_linear loads strictly, with the same logits."""
    from transformers import KimiLinearForCausalLM  # noqa: PLC0415 (optional: transformers)


    hf, cfg, model, _ = pair
    write_checkpoint(tmp_path, checkpoint_tensors(model, cfg), max_shard_bytes=1 << 20)
    raw = {**cfg.to_dict(), "model_type": "kimi_linear", "pad_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    again, info = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info                      # nothing missing, unexpected or mismatched
    ids = torch.randint(3, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(7))
    assert rel_norm_error(hf_logits(again.eval(), ids), hf_logits(hf, ids)) <= 1e-6
