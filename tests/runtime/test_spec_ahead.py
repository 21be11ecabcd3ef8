"""Speculation overlapped with the host (runtime/spec_ahead.py): the verify step after a verify step
is launched on the device's acceptance of it, before the host commits. Greedy speculative output
with the overlap equals plain greedy decoding token for token, with drafts accepted and rejected,
requests ending mid-block (a stop id, max_tokens), arriving and aborted mid-flight, with prefix
caching on and off; nothing leaks. On the CPU the graph session runs its static padded steps
uncaptured (cuda_graphs=True), which is where the device ids and the shift go in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from runtime_utils import arrival_and_abort_while_ahead, assert_released, prompts

from k3trt.runtime import spec_ahead
from k3trt.runtime.llm import LLM
from k3trt.runtime.mtp_ahead import MTPAhead
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.spec_ahead import DeviceDrafter, accept_on_device
from k3trt.runtime.speculative import Drafter, DraftInput, Proposal, accept_greedy
from k3trt.runtime.speculative.mtp import MTPDrafter

LENGTHS = [5, 30, 12, 3]
MAX_TOKENS = [20, 9, 14, 20]
K = 3


class TableDrafter(Drafter):
    """Drafts by chaining a next-token table (built from the reference outputs, so most drafts are
    right; every `wrong`-th entry is off by one, so some are rejected), on the host."""
    name = "table"

    def __init__(self, refs: list[list[int]], vocab: int, wrong: int, device: str = "cpu"):
        table = torch.zeros(vocab, dtype=torch.int64)
        for ref in refs:
            for a, b in zip(ref, ref[1:]):
                table[a] = b
        table[::wrong] += 1
        self.host_table, self.table = table.tolist(), table.to(device)
        self.device_calls = 0

    def propose(self, inputs, k):
        out = []
        for inp in inputs:
            d, t = [], inp.token_ids[-1]
            for _ in range(inp.limit(k)):
                t = self.host_table[t]
                d.append(t)
            out.append(d)
        return Proposal(out, [None] * len(out))


class DeviceTableDrafter(TableDrafter):
    """The same table, chained on the device from the device's bonus tokens (spec_ahead.DeviceDrafter)."""

    def propose_on_device(self, reqs, bonus, hidden, num_accepted, k):
        self.device_calls += 1
        d, t = [], bonus
        for _ in range(max(k)):
            t = self.table[t]
            d.append(t)
        return torch.stack(d, 1)


@pytest.fixture(scope="module")
def reference(engine):
    llm = LLM(engine, verify_checksums=False, cuda_graphs=False)
    ps = prompts(11, LENGTHS)
    outs = [llm.generate([p], SamplingParams(max_tokens=n))[0].token_ids for p, n in zip(ps, MAX_TOKENS)]
    return ps, outs


def spec_llm(engine, reference, *, wrong: int = 5, **kw) -> LLM:
    llm = LLM(engine, verify_checksums=False, cuda_graphs=True, speculative="ngram", spec_tokens=K, **kw)
    llm.spec.drafter = DeviceTableDrafter(reference[1], llm.vocab_size, wrong)
    assert isinstance(llm.spec.drafter, DeviceDrafter)
    return llm


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_overlapped_speculation_equals_plain_greedy(engine, reference, prefix_caching):
    ps, want = reference
    llm = spec_llm(engine, reference, prefix_caching=prefix_caching, block_size=16)
    # request 1 ends on a stop id the host sees only after the next verify step was launched
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    params[1] = SamplingParams(max_tokens=MAX_TOKENS[1], stop_token_ids=[want[1][5]])
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == [w[:6] if i == 1 else w for i, w in enumerate(want)]
    assert outs[1].finish_reason == "stop" and outs[0].finish_reason == "length"
    spec = llm.stats()["speculative"]
    assert llm.stats()["launched_ahead"] > 0 and llm.spec.drafter.device_calls > 0
    assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]          # accepted and rejected drafts
    assert_released(llm)


def test_arrivals_and_abort_while_a_verify_step_is_ahead(engine, reference):
    ps, want = reference
    llm = spec_llm(engine, reference, prefix_caching=False)
    arrival_and_abort_while_ahead(llm, ps, want, MAX_TOKENS, warm_steps=3)     # a verify step ahead


def test_all_drafts_rejected_and_a_failed_launch(engine, reference, monkeypatch):
    """Every draft wrong: acceptance 0 on the device, the KDA state rolled back there; then a launch
    that raises: the step commits synchronously and nothing is lost."""
    ps, want = reference
    llm = spec_llm(engine, reference, wrong=1, prefix_caching=False, adaptive_k=False)
    outs = llm.generate(ps[:2], [SamplingParams(max_tokens=n) for n in MAX_TOKENS[:2]])
    assert [o.token_ids for o in outs] == want[:2] and llm.stats()["launched_ahead"] > 0
    assert llm.stats()["speculative"]["accepted_tokens"] == 0
    assert_released(llm)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(spec_ahead, "launch", broken)
    llm = spec_llm(engine, reference, prefix_caching=False)
    outs = llm.generate(ps[:2], [SamplingParams(max_tokens=n) for n in MAX_TOKENS[:2]])
    assert [o.token_ids for o in outs] == want[:2] and llm.stats()["launched_ahead"] == 0
    assert_released(llm)


@pytest.mark.parametrize("seed", range(4))
def test_accept_on_device_is_accept_greedy(seed):
    g = torch.Generator().manual_seed(seed)
    B, K_ = 16, 4
    target = torch.randint(0, 3, (B, K_ + 1), generator=g)
    drafts = torch.where(torch.rand(B, K_, generator=g) < 0.8, target[:, :K_], torch.randint(0, 3, (B, K_), generator=g))
    nd = torch.randint(0, K_ + 1, (B,), generator=g)
    n, bonus = accept_on_device(target, drafts, nd)
    ref = accept_greedy(target, drafts, nd)
    assert n.tolist() == ref.num_accepted
    assert [d[:m] + [b] for d, m, b in zip(drafts.tolist(), n.tolist(), bonus.tolist())] == ref.tokens
    assert len(set(n.tolist())) > 2


def test_a_device_drafter_fault_keeps_the_steps_synchronous(engine, reference, caplog):
    """propose_on_device raising: the step commits synchronously, the host drafts the next ones,
    and the requests go on (the drafter's device path is optional, not part of the request)."""
    ps, want = reference
    llm = spec_llm(engine, reference, prefix_caching=False)

    def broken(*args, **kwargs):
        raise RuntimeError("device drafting exploded")
    llm.spec.drafter.propose_on_device = broken
    outs = llm.generate(ps[:2], [SamplingParams(max_tokens=n) for n in MAX_TOKENS[:2]])
    assert [o.token_ids for o in outs] == want[:2] and all(o.error is None for o in outs)
    assert llm.stats()["speculative"]["accepted_tokens"] > 0
    assert sum("device drafting exploded" in r.message for r in caplog.records) == 1     # tried once
    assert_released(llm)


# ------------------------------------------------------------------------------------ MTP
def drafts_by_step(llm: LLM, ps, params) -> tuple[list, dict]:
    """Generate, recording every request's drafts at each of its verify steps (what the step
    verified: the host's drafts or the device's)."""
    seen: dict[str, list] = {}
    commit = llm.loop._commit_one

    def spy(req, v, hidden):
        seen.setdefault(req.request_id, []).append((len(req.token_ids), list(req.drafts)))
        return commit(req, v, hidden)
    llm.loop._commit_one = spy
    outs = llm.generate(ps, params)
    return [o.token_ids for o in outs], {o.request_id: seen[o.request_id] for o in outs}


def test_mtp_drafts_on_the_device_as_on_the_host(engine, reference):
    """MTP drafting on the device (mtp_ahead.py) proposes what the MTP drafter proposes on the host
    for the same history, step for step, and greedy output equals plain greedy decoding."""
    ps, want = reference
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    runs = []
    for graphs in (False, True):           # False: the MTP drafter itself, every step synchronous
        llm = LLM(engine, verify_checksums=False, cuda_graphs=graphs, speculative="mtp", spec_tokens=K,
                  adaptive_k=False, prefix_caching=False)
        assert (type(llm.spec.drafter).__name__ == "MTPAhead") == graphs
        tokens, drafts = drafts_by_step(llm, ps, params)
        assert tokens == want
        assert (llm.stats()["launched_ahead"] > 0) == graphs
        assert_released(llm)
        runs.append(drafts)
    host, device = runs
    assert host.keys() == device.keys()
    for rid in host:
        # the device launch drafts for one token less of room at the end (cut there): compare the
        # steps both ran, by committed length
        h, d = dict(host[rid]), dict(device[rid])
        common = sorted(set(h) & set(d))
        assert len(common) >= 2
        assert all(h[c][:len(d[c])] == d[c][:len(h[c])] for c in common), rid


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static_steps"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_mtp_device_drafts_equal_host_drafts_after_n_accepted(tiny_model, n, reduced, graphs):
    """The same MTP state and verify step on two drafters: the device's drafts from (n, bonus, the
    step's hidden rows) equal the host's after it commits drafts[:n] + [bonus], and both then go on
    drafting alike (the hand-over moves the device-drafted one's bookkeeping to the host's); with a
    reduced draft vocabulary both score only its ids; the device's steps run as the drafter's static
    (graph) steps, its inputs written in on the device, or eagerly."""
    cfg, model = tiny_model
    g = torch.Generator().manual_seed(n)
    H = cfg.hidden_size
    x = torch.randint(1, 1000, (11,), generator=g).tolist()
    hid = torch.randn(len(x) + 16, H, generator=g)
    ids = torch.randperm(cfg.vocab_size, generator=g)[:cfg.vocab_size // 8] if reduced else None
    drafters = [MTPDrafter(model, cfg, k_max=K, max_live=2, max_model_len=64, draft_vocab=ids, graphs=graphs)
                for _ in range(2)]
    host, dev = drafters[0], MTPAhead(drafters[1])
    for d in (host, dev):                    # prompt handed over, one token sampled, drafts for step N
        d.on_hidden("r", 0, hid[:len(x) - 1])
    drafts = host.propose([DraftInput("r", x)], K).tokens[0]
    assert dev.propose([DraftInput("r", x)], K).tokens[0] == drafts and len(drafts) == K
    V = torch.randn(K + 1, H, generator=g)   # step N's rows: [x[-1], *drafts]
    bonus = int(torch.randint(1, 1000, (1,), generator=g))
    req = SimpleNamespace(request_id="r", token_ids=x, drafts=drafts)
    static = drafters[1].stats().get("static_steps", 0)
    got = dev.propose_on_device([req], torch.tensor([bonus]), V[None], torch.tensor([n]), [K])[0].tolist()
    assert drafters[1].stats().get("static_steps", 0) - static == (K if graphs else 0)     # step 0 + K - 1 chained
    kept = drafts[:n] + [bonus]
    x2 = x + kept
    for d in (host, dev):                    # N's commit
        d.on_hidden("r", len(x) - 1, V[:n + 1])
        d.on_commit("r", kept)
    want = host.propose([DraftInput("r", x2)], K).tokens[0]
    assert got == want
    if reduced:
        assert set(got) <= set(ids.tolist())
    # one more step on the host path for both: the device-drafted one picks up where it left
    V2, b2 = torch.randn(K + 1, H, generator=g), 7
    x3 = x2 + [b2]
    for d in (host, dev):
        d.on_hidden("r", len(x2) - 1, V2[:1])
        d.on_commit("r", [b2])
    assert dev.propose([DraftInput("r", x3)], K).tokens[0] == host.propose([DraftInput("r", x3)], K).tokens[0]
    for d in (host, dev):
        d.release("r")
    assert not dev.seqs and not dev.ahead
