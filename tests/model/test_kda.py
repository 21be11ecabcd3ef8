"""KDA: the plugin ops against the per-token oracle and each other, fla-core's naive reference, and
the model layer's slot state across calls (prefill then decode, verification step states)."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from k3trt.config import ModelConfig
from k3trt.model.context import KDALayerCache, ModelCache, StepContext
from k3trt.model.kda import KDA
from k3trt.model.presets import preset_config
from k3trt.plugins import kda as ops
from k3trt.testing import assert_close

F32 = torch.float32
# Layer outputs pass the KDA output through an RMSNorm, which scales up a head's rounding error
# when its output is small, so cross-path layer comparisons allow a little more absolute error.
LAYER_TOL = dict(dtype=F32, atol=5e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ----------------------------------------------------------------------------- op inputs
@dataclass(frozen=True)
class Case:
    T: int
    H: int = 2
    dk: int = 16
    dv: int = 16
    gmin: float = -1.0        # decays drawn uniformly from [gmin, 0]
    init_state: bool = True
    batch: int | None = None  # None: one sequence [T, H, ...]

    def inputs(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        lead = (self.T,) if self.batch is None else (self.batch, self.T)
        r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        q = F.normalize(r(*lead, self.H, self.dk), dim=-1)
        k = F.normalize(r(*lead, self.H, self.dk), dim=-1)
        v = r(*lead, self.H, self.dv)
        g = torch.rand(*lead, self.H, self.dk, generator=gen) * self.gmin
        beta = torch.rand(*lead, self.H, generator=gen)
        state = r(*lead[:-1], self.H, self.dk, self.dv) if self.init_state else \
            torch.zeros(*lead[:-1], self.H, self.dk, self.dv)
        return q, k, v, g, beta, state


RECURRENT_CASES = [Case(T=1, H=1, dk=8, dv=8, init_state=False), Case(T=37, dk=16, dv=8),
                   Case(T=20, H=3, dk=8, dv=16, gmin=-5.0, init_state=False), Case(T=12, dk=32, dv=32, gmin=-0.05)]


@pytest.mark.parametrize("case", RECURRENT_CASES, ids=str)
def test_recurrent_matches_loop(case):
    q, k, v, g, beta, state = case.inputs()
    scale = case.dk ** -0.5
    o, final, states = ops.kda_recurrent(q, k, v, g, beta, state, scale, True)
    ro, rfinal, rstates = ops.kda_reference_loop(q, k, v, g, beta, state, scale)
    assert_close(o, ro, dtype=F32, name="o")
    assert_close(final, rfinal, dtype=F32, name="final state")
    assert_close(states, rstates, dtype=F32, name="state after each position")
    assert torch.equal(states[-1], final)
    o2, final2, none = ops.kda_recurrent(q, k, v, g, beta, state, scale, False)
    assert torch.equal(o2, o) and torch.equal(final2, final) and none.numel() == 0


def test_recurrent_batched_equals_single():
    case = Case(T=9, batch=3, gmin=-2.0)
    q, k, v, g, beta, state = case.inputs(1)
    o, final, states = ops.kda_recurrent(q, k, v, g, beta, state, 0.3, True)
    assert states.shape == (3, 9, case.H, case.dk, case.dv)
    for b in range(3):
        ob, fb, sb = ops.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], state[b], 0.3, True)
        assert_close(o[b], ob, dtype=F32)
        assert_close(final[b], fb, dtype=F32)
        assert_close(states[b], sb, dtype=F32)


def test_recurrent_prefix_states_bitwise():
    """The state saved after position j is exactly the final state of running positions 0..j."""
    q, k, v, g, beta, state = Case(T=6, gmin=-3.0).inputs(2)
    _, _, states = ops.kda_recurrent(q, k, v, g, beta, state, 0.25, True)
    for j in range(6):
        _, fj, _ = ops.kda_recurrent(q[:j + 1], k[:j + 1], v[:j + 1], g[:j + 1], beta[:j + 1], state, 0.25, False)
        assert torch.equal(states[j], fj), j


CHUNKED_CASES = [Case(T=1), Case(T=5, gmin=-5.0), Case(T=64), Case(T=100, gmin=-5.0), Case(T=150, gmin=-0.02),
                 Case(T=130, gmin=-50.0, init_state=False), Case(T=40, H=1, dk=32, dv=8, batch=2, gmin=-5.0)]


@pytest.mark.parametrize("case", CHUNKED_CASES, ids=str)
@pytest.mark.parametrize("chunk", [64, 16])
def test_chunked_matches_recurrent(case, chunk):
    q, k, v, g, beta, state = case.inputs(3)
    scale = case.dk ** -0.5
    o, final, _ = ops.kda_recurrent(q, k, v, g, beta, state, scale, False)
    oc, finalc = ops.kda_chunked(q, k, v, g, beta, state, scale, chunk)
    assert_close(oc, o, dtype=F32, name="o")
    assert_close(finalc, final, dtype=F32, name="final state")


def test_chunked_at_gate_floor_is_finite_and_exact():
    """Every decay at the lowest value the -5 lower-bound gate allows: a 64-chunk's cumulative decay
    reaches -320, far past fp32's exp range, yet nothing overflows and the forms agree."""
    case = Case(T=128, dk=16, dv=16)
    q, k, v, _, beta, state = case.inputs(4)
    g = torch.full_like(q, -5.0)
    g[:, 0, :4] = 0.0   # one head keeps some channels undecayed, so the state is not simply reset
    o, final, _ = ops.kda_recurrent(q, k, v, g, beta, state, 0.25, False)
    oc, finalc = ops.kda_chunked(q, k, v, g, beta, state, 0.25)
    assert torch.isfinite(oc).all() and torch.isfinite(finalc).all()
    assert_close(oc, o, dtype=F32)
    assert_close(finalc, final, dtype=F32)


def test_chunked_strong_then_weak_decay():
    """A near-reset early in each chunk, then almost no decay: the chunk-relative cumulative decays
    are large while the spans between later positions are tiny, which a G_t - G_i formulation
    rounds badly (relative error ~1e-5 here); the forms must still agree to fp32 precision."""
    case = Case(T=128, dk=16, dv=16)
    q, k, v, _, beta, state = case.inputs(7)
    g = torch.full_like(q, -1e-3)
    g[:8], g[64:72] = -60.0, -60.0
    ro, rfinal, _ = ops.kda_reference_loop(q, k, v, g, beta, state, 0.25)
    oc, finalc = ops.kda_chunked(q, k, v, g, beta, state, 0.25)
    assert_close(oc, ro, dtype=F32)
    assert_close(finalc, rfinal, dtype=F32)


def test_bf16_inputs():
    q, k, v, g, beta, state = Case(T=70, gmin=-2.0).inputs(5)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ro, rfinal, _ = ops.kda_reference_loop(qb, kb, vb, g, beta, state, 0.25)
    for o, final in (ops.kda_recurrent(qb, kb, vb, g, beta, state, 0.25, False)[:2],
                     ops.kda_chunked(qb, kb, vb, g, beta, state, 0.25)):
        assert o.dtype == torch.bfloat16 and final.dtype == F32
        assert_close(o, ro, dtype=torch.bfloat16)
        assert_close(final, rfinal, dtype=F32)


def test_fake_shapes():
    with FakeTensorMode():
        q, k, v, g, beta, state = Case(T=7, batch=2, dv=8).inputs()
        o, final, states = torch.ops.k3trt.kda_recurrent(q, k, v, g, beta, state, 1.0, True)
        assert o.shape == v.shape and final.shape == state.shape and states.shape == (2, 7, 2, 16, 8)
        o, final = torch.ops.k3trt.kda_chunked(q, k, v, g, beta, state, 1.0)
        assert o.shape == v.shape and final.shape == state.shape
        x, w, st = torch.randn(2, 7, 12), torch.randn(12, 1, 4), torch.randn(2, 12, 3)
        y, w, ws = torch.ops.k3trt.short_conv(x, w, st, True)
        assert y.shape == (2, 7, 12) and w.shape == (2, 12, 3) and ws.shape == (2, 7, 12, 3)


def _opcheck_cases():
    q, k, v, g, beta, state = Case(T=10, batch=2, dv=8).inputs(8)
    one = (q[0].bfloat16(), k[0].bfloat16(), v[0].bfloat16(), g[0], beta[0], state[0])
    x, w, st = torch.randn(2, 5, 6), torch.randn(6, 1, 4), torch.randn(2, 6, 3)
    return [(ops.kda_recurrent, (q, k, v, g, beta, state, 0.5, True)), (ops.kda_recurrent, (*one, 0.5, False)),
            (ops.kda_chunked, (q, k, v, g, beta, state, 0.5, 4)), (ops.kda_chunked, (*one, 0.5)),
            (ops.short_conv, (x, w, st, True)), (ops.short_conv, (x[0].bfloat16(), w, st[0].bfloat16(), False))]


@pytest.mark.parametrize("i", range(6))
def test_opcheck(i):
    """Schema, fake implementation (shapes, dtypes, strides) and tracing agree with the real op."""
    op, args = _opcheck_cases()[i]
    torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------- short conv
@pytest.mark.parametrize("K", [1, 2, 4])
def test_short_conv_matches_conv1d(K):
    gen = torch.Generator().manual_seed(K)
    T, C = 11, 6
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, 1, K, generator=gen)
    st = torch.randn(C, K - 1, generator=gen)
    full = torch.cat([st, x.T], 1)                                   # [C, K-1+T]
    ref = F.silu(F.conv1d(full.unsqueeze(0), w, groups=C))[0].T      # [T, C]
    y, new, windows = ops.short_conv(x, w, st, True)
    assert_close(y, ref, dtype=F32)
    assert torch.equal(new, full[:, T:])
    for t in range(T):
        assert torch.equal(windows[t], full[:, t + 1:t + K]), t
    # pieces with the window carried equal one call, and the batched form equals per-row calls
    ys, cur = [], st
    for a, b in ((0, 1), (1, 5), (5, 6), (6, T)):
        yp, cur, _ = ops.short_conv(x[a:b], w, cur)
        ys.append(yp)
    # (values, not bits: the vectorised SiLU rounds a tensor's tail differently from its body)
    assert_close(torch.cat(ys), y, dtype=F32)
    assert torch.equal(cur, new)
    yb, newb, _ = ops.short_conv(torch.stack([x, -x]), w, torch.stack([st, st]))
    assert_close(yb[0], y, dtype=F32)
    assert torch.equal(newb[0], new)


# ----------------------------------------------------------------------------- fla-core
def _fla_naive():
    """fla.ops.kda.naive, loaded by file: importing the fla.ops package needs triton (absent on CPU
    machines), while naive.py itself needs only torch and einops."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.exists() or importlib.util.find_spec("einops") is None:
        pytest.skip(f"fla-core's naive KDA reference ({path}) or einops is missing")
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def test_matches_fla_naive():
    """fla's layout is [B, T, H, K], its state [B, H, K, V], scale applied to q: the same convention."""
    naive = _fla_naive()
    case = Case(T=32, batch=2, H=2, dk=16, dv=8, gmin=-1.0)
    q, k, v, g, beta, state = case.inputs(6)
    o, final, _ = ops.kda_recurrent(q, k, v, g, beta, state, 0.2, False)
    fo, ffinal = naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.2, initial_state=state, output_final_state=True)
    assert_close(o, fo, dtype=F32, name="o vs fla naive_recurrent_kda")
    assert_close(final, ffinal, dtype=F32, name="state vs fla naive_recurrent_kda")
    # fla's naive chunk form needs T % chunk == 0, and forms e^{G_t - G_i} for t < i before masking
    # them, so it only runs with mild decays
    co, cfinal = naive.naive_chunk_kda(q, k, v, g, beta, scale=0.2, initial_state=state,
                                       output_final_state=True, chunk_size=16)
    oc, finalc = ops.kda_chunked(q, k, v, g, beta, state, 0.2, 16)
    assert_close(oc, co, dtype=F32, name="o vs fla naive_chunk_kda")
    assert_close(finalc, cfinal, dtype=F32, name="state vs fla naive_chunk_kda")


# ----------------------------------------------------------------------------- the model layer
def _cfg(**la_overrides) -> ModelConfig:
    cfg = ModelConfig.from_dict(preset_config("tiny", vocab_size=256))
    return dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(cfg.linear_attn_config, **la_overrides))


def _layer(cfg: ModelConfig, seed: int = 0) -> KDA:
    layer = KDA(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name == "o_norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:   # fan-in scaled, so activations stay O(1)
                p.copy_(torch.randn(p.shape, generator=gen) * p[0].numel() ** -0.5)
    return layer


def _cache(cfg: ModelConfig, slots: int = 4, max_q: int = 8, dtype=F32) -> KDALayerCache:
    return ModelCache.allocate(cfg, num_blocks=1, block_size=16, num_slots=slots, max_q=max_q,
                               dtype=dtype, layers=range(1)).kda[0]


def _ctx(q_lens, ctx_lens, slots, save=False) -> StepContext:
    return StepContext(q_lens=tuple(q_lens), ctx_lens=tuple(ctx_lens),
                       slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
                       block_table=torch.zeros(len(q_lens), 1, dtype=torch.int32),
                       kda_slots=torch.tensor(slots, dtype=torch.long), save_kda_states=save)


def _run_pieces(layer, x, cache, pieces, slot=0, start=0):
    outs, pos = [], start
    for n in pieces:
        outs.append(layer(x[pos - start:pos - start + n], _ctx([n], [pos], [slot]), cache))
        pos += n
    return torch.cat(outs)


GATES = [dict(), dict(gate_lower_bound=None), dict(use_full_rank_gate=False)]


def test_parameter_names():
    names = set(dict(KDA(_cfg()).named_parameters()))
    common = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
              "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias", "b_proj.weight",
              "o_norm.weight", "o_proj.weight"}
    assert names == common | {"g_proj.weight"}
    low_rank = set(dict(KDA(_cfg(use_full_rank_gate=False)).named_parameters()))
    assert low_rank == common | {"g_a_proj.weight", "g_b_proj.weight"}
    with torch.device("meta"):
        assert KDA(_cfg()).q_conv1d.weight.shape == (2 * 32, 1, 4)


@pytest.mark.parametrize("gate", GATES, ids=str)
def test_layer_pieces_equal_one_call(gate):
    """Prefill (chunked) then decodes and a short recurrent piece, through the slot state, equal one
    chunked call over the whole sequence and one recurrent call."""
    cfg = _cfg(**gate)
    layer = _layer(cfg)
    x = torch.randn(32, cfg.hidden_size)
    whole = _run_pieces(layer, x, _cache(cfg), [32], slot=1)
    cache = _cache(cfg)
    pieces = _run_pieces(layer, x, cache, [20, 1, 1, 1, 5, 4], slot=1)
    assert_close(pieces, whole, **LAYER_TOL)
    layer.chunked_min_tokens = 10 ** 6
    recurrent_cache = _cache(cfg)
    assert_close(_run_pieces(layer, x, recurrent_cache, [32], slot=1), whole, **LAYER_TOL, name="recurrent path")
    assert_close(cache.state[1], recurrent_cache.state[1], dtype=F32, name="slot state")
    assert torch.equal(cache.conv[1], recurrent_cache.conv[1])
    assert not cache.state[[0, 2, 3]].any() and not cache.conv[[0, 2, 3]].any()


def test_layer_mixed_batch_equals_separate():
    """One step with sequences of different lengths, some continuing and some new, equals running
    each sequence alone; then a uniform (batched) decode step equals per-sequence decodes."""
    cfg = _cfg()
    layer = _layer(cfg, 1)
    xs = [torch.randn(n, cfg.hidden_size) for n in (24, 3, 6)]
    sep = _cache(cfg)
    _run_pieces(layer, xs[0][:5], sep, [5], slot=2)
    ref = [_run_pieces(layer, xs[0][5:], sep, [19], slot=2, start=5),
           _run_pieces(layer, xs[1], sep, [3], slot=0), _run_pieces(layer, xs[2], sep, [6], slot=3)]
    mixed = _cache(cfg)
    _run_pieces(layer, xs[0][:5], mixed, [5], slot=2)
    out = layer(torch.cat([xs[0][5:], xs[1], xs[2]]), _ctx([19, 3, 6], [5, 0, 0], [2, 0, 3]), mixed)
    assert_close(out, torch.cat(ref), **LAYER_TOL)
    assert_close(mixed.state, sep.state, dtype=F32)
    assert_close(mixed.conv, sep.conv, dtype=F32)
    step = torch.randn(3, cfg.hidden_size)
    batched = layer(step, _ctx([1, 1, 1], [24, 3, 6], [2, 0, 3]), mixed)
    single = torch.cat([layer(step[i:i + 1], _ctx([1], [c], [s]), sep)
                        for i, (c, s) in enumerate([(24, 2), (3, 0), (6, 3)])])
    assert_close(batched, single, **LAYER_TOL)
    assert_close(mixed.state, sep.state, dtype=F32)


def test_layer_saved_step_states():
    """A verification step saves the state and window after each position; each equals the slot
    after running only that prefix, and rolling back to one then decoding equals decoding after
    the prefix. Rows past the step and other slots stay untouched (NaN poison).

    Bitwise equality holds for the op (test_recurrent_prefix_states_bitwise) and for the last
    position here; across calls with different token counts the CPU GEMM itself is not bitwise
    row-independent (1 or 2 rows round differently from 4), so earlier positions get fp32 budgets."""
    cfg = _cfg()
    layer = _layer(cfg, 2)
    x = torch.randn(15, cfg.hidden_size)
    base = _cache(cfg, max_q=6)
    _run_pieces(layer, x, base, [10], slot=3)

    def copy(c, poison=False):
        fill = (lambda t: torch.full_like(t, float("nan"))) if poison else torch.clone
        return dataclasses.replace(c, state=c.state.clone(), conv=c.conv.clone(),
                                   step_state=fill(c.step_state), step_conv=fill(c.step_conv))

    verify = copy(base, poison=True)
    out = layer(x[10:14], _ctx([4], [10], [3], save=True), verify)
    plain = copy(base)
    assert torch.equal(out, layer(x[10:14], _ctx([4], [10], [3]), plain))
    assert torch.equal(verify.step_state[3, 3], plain.state[3])
    assert torch.equal(verify.step_conv[3, 3], plain.conv[3])
    assert torch.equal(verify.step_state[3, 3], verify.state[3])
    for j in range(4):
        prefix = copy(base)
        layer(x[10:11 + j], _ctx([j + 1], [10], [3]), prefix)
        assert_close(verify.step_state[3, j], prefix.state[3], dtype=F32, name=f"step state {j}")
        assert_close(verify.step_conv[3, j], prefix.conv[3], dtype=F32, name=f"step conv {j}")
        # commit j+1 tokens: roll the slot back, then decode the next token
        rolled = copy(verify)
        rolled.state[3], rolled.conv[3] = verify.step_state[3, j], verify.step_conv[3, j]
        nxt = torch.randn(1, cfg.hidden_size)
        assert_close(layer(nxt, _ctx([1], [11 + j], [3]), rolled), layer(nxt, _ctx([1], [11 + j], [3]), prefix),
                     **LAYER_TOL, name=f"decode after rollback to {j}")
    assert verify.step_state[3, 4:].isnan().all() and verify.step_state[:3].isnan().all()
    assert verify.step_conv[3, 4:].isnan().all() and verify.step_conv[:3].isnan().all()


def test_fresh_sequence_ignores_slot_garbage():
    cfg = _cfg()
    layer = _layer(cfg, 3)
    x = torch.randn(5, cfg.hidden_size)
    clean = _cache(cfg)
    ref = layer(x, _ctx([5], [0], [1]), clean)
    dirty = _cache(cfg)
    for t in (dirty.state, dirty.conv):
        t.fill_(float("nan"))
    out = layer(x, _ctx([5], [0], [1]), dirty)
    assert torch.equal(out, ref)
    assert torch.equal(dirty.state[1], clean.state[1]) and torch.equal(dirty.conv[1], clean.conv[1])
    assert dirty.state[[0, 2, 3]].isnan().all()   # other slots untouched


def test_layer_bf16():
    """bf16 weights and activations against fp32 arithmetic on the same (bf16-rounded) weights and
    inputs: only the activation rounding differs. The state stays fp32."""
    cfg = _cfg()
    layer16 = _layer(cfg, 4).to(torch.bfloat16)
    x = torch.randn(24, cfg.hidden_size).bfloat16()
    ref = _run_pieces(_layer(cfg, 4).to(torch.bfloat16).float(), x.float(), _cache(cfg), [24])
    cache16 = _cache(cfg, dtype=torch.bfloat16)
    out = _run_pieces(layer16, x, cache16, [20, 1, 3])
    assert out.dtype == torch.bfloat16 and cache16.state.dtype == F32
    # about eight bf16 roundings in series (five projections, conv, gated norm, o_proj): the
    # relative-norm error is typically 0.6-1%, single elements up to ~0.05 over 60 seeds
    assert_close(out, ref, dtype=torch.bfloat16, atol=8e-2, rel_norm=2e-2)
