"""The device-resident drafter equals the host block / LiLiCorr drafter, and decoding with it
inside the speculative step equals AR greedy.

On the CPU every body runs eagerly (`use_graph=False`); the `gpu` cases capture the graphs
and check them against GraphedAR and the eager path, also with the trained embedded pair in
bf16 (skipped where the assets are absent).
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from specla.graphs.spec import spec_vs_ar_noise
from specla.decode import DecodeSettings, ar_generate
from specla.drafters import new_drafter
from specla.drafters.base import Accepted, DraftContext, DraftSettings
from specla.engine import Engine
from specla.graphs.ar import GraphedAR
from specla.graphs.decoders import GraphedDecoder
from specla.graphs.drafters import DeviceBlockDrafter
from specla.graphs.runtime import PackedTarget
from specla.graphs.spec import GraphedSpec, SpecState
from specla.model import random_gdn
from tests.helpers import random_target

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: graphs are captured only there")
DEVICES = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])]

KINDS = ("block", "lilicorr")
LAYERS = (0, 1)
WINDOW = 8            # small, so a few steps fill it and wrap it
BLOCK = 6             # root + 5 drafted slots
ROOT = Path(__file__).resolve().parent.parent
# fp32 tolerance of a "same token" check: a pick may differ only where the host's own scores
# tie this closely (batched vs unbatched products round differently)
NEAR_TIE = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")     # tiny models: two threads thrash a small CPU


def pair(kind: str, device: str = "cpu", vocab: int = 128, seed: int = 1):
    target = random_target(vocab=vocab).to(device)
    torch.manual_seed(seed)
    kw = dict(width=32, heads=2, mlp_hidden=64, window=WINDOW)
    if kind == "lilicorr":
        kw["head"] = dict(width=32, heads=2, mlp_hidden=64)
    drafter = new_drafter(kind, target, feature_layers=LAYERS, block_size=BLOCK, top_k=4, **kw)
    return target, drafter


def chain_settings() -> DraftSettings:
    return DraftSettings(tree="chain", block_size=BLOCK, top_k=4, budget=BLOCK - 1)


def prompt_of(length: int, vocab: int = 128, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def host_chain_gap(host, draft, device_tokens: list[int]) -> float | None:
    """None if the device chain equals the host draft; else the host's own score gap between
    its pick and the device's at the first differing slot (a near-tie if tiny)."""
    host_tokens = draft.tree.tokens[1:]
    s = next((i for i, (x, y) in enumerate(zip(host_tokens, device_tokens)) if x != y), None)
    if s is None:
        return None
    lat = draft.details.get("lattice")
    if lat is None:                      # block: the slot marginals
        cands, logps = draft.details["slots"]["candidates"][s], draft.details["slots"]["logprobs"][s]
        if device_tokens[s] not in cands:
            return float("inf")
        return logps[0] - logps[cands.index(device_tokens[s])]
    row = lat["start"] if s == 0 else lat["pair"][s - 1][lat["chosen"][s - 1]]
    cands = lat["candidates"][s]
    if device_tokens[s] not in cands:
        return float("inf")
    return row[lat["chosen"][s]] - row[cands.index(device_tokens[s])]


# --------------------------------------------------------------------------- the window

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [0, 3, WINDOW, WINDOW + 5])
def test_masked_right_aligned_window_equals_the_host_context(kind, rows):
    """n rows of context: the host holds n rows at positions W-n..W-1; the device holds W rows,
    the first W-n masked. Same slot logits (and a wrongly aligned window would not be)."""
    target, drafter = pair(kind)
    rt = PackedTarget(target)
    prompt = prompt_of(rows + 1)
    _, feats, hidden = rt.prefill(prompt, LAYERS)
    drafter.reset(prompt, feats, hidden)
    dev = DeviceBlockDrafter(drafter, chain_settings())
    dev.reset(prompt, feats if rows else None, None)
    n = min(rows, WINDOW)
    assert int(dev.valid.sum()) == n and bool(dev.valid[WINDOW - n:].all())
    assert torch.equal(dev.ctx[WINDOW - n:], drafter.ctx)
    for (k, v), (hk, hv) in zip(dev.kv, drafter.ctx_kv):
        assert torch.equal(k[WINDOW - n:], hk) and torch.equal(v[WINDOW - n:], hv)
    root = torch.tensor([prompt[-1]])
    h_host, logits_host = drafter._slots(prompt[-1])
    h_dev, logits_dev = dev.slot_logits(root)
    assert torch.allclose(logits_dev[0], logits_host, atol=1e-5, rtol=1e-5)
    assert torch.allclose(h_dev[0], h_host, atol=1e-5, rtol=1e-5)
    if 0 < n < WINDOW:   # the same rows at the front of the window: other positions, other logits
        dev.ctx.copy_(dev.ctx.roll(-(WINDOW - n), 0))
        dev.valid.copy_(dev.valid.roll(-(WINDOW - n), 0))
        for k, v in dev.kv:
            k.copy_(k.roll(-(WINDOW - n), 0)), v.copy_(v.roll(-(WINDOW - n), 0))
        assert not torch.allclose(dev.slot_logits(root)[1][0], logits_host, atol=1e-3)


def test_device_drafter_refuses_what_it_cannot_draft():
    _, drafter = pair("lilicorr")
    sampled = DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK, temperature=0.5))
    assert sampled.samples_chains, "at temperature > 0 a chain is drawn (with its proposal)"
    with pytest.raises(ValueError, match="at most 4 candidates"):
        DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK, top_k=5))
    with pytest.raises(ValueError, match="block size"):
        DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK + 1))
    short = DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK, tree="chain", budget=3))
    assert short.kind == "lilicorr" and short.template().tokens == [0] * 4 and not short.dynamic
    tree = DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK, tree="best-first", budget=9))
    assert tree.dynamic and len(tree.template()) == 10 and tree.max_depth == BLOCK - 1
    # the fused head is a CUDA kernel: asked for on the CPU it says so, by default it is off
    with pytest.raises(ValueError, match="fused LiLiCorr head cannot run here: it needs a CUDA"):
        DeviceBlockDrafter(drafter, chain_settings(), fused_head=True)
    assert DeviceBlockDrafter(drafter, chain_settings()).fused_head is None


# --------------------------------------------------------------------------- step by step

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_device_chains_equal_host_proposals_step_by_step(kind, device):
    """Drive the speculative step with scripted drafts (the AR truth for a random number of
    slots, then a wrong token), so every acceptance length 0..S occurs and the window of 8
    fills and wraps. Before each step the device drafter's chain (drafted inside the step,
    from the accepted path) equals the host drafter's `propose`, and its window equals the
    host's context, after the host `observe`d the same accepted rows."""
    target, host = pair(kind, device)
    rt = PackedTarget(target)
    settings = chain_settings()
    dev = DeviceBlockDrafter(host, settings)
    S = dev.nodes - 1
    state = SpecState(rt, max_path=S + 1, capacity=256)
    dev.bind(state.log)
    spec = GraphedSpec(rt, state, dev.template(), feature_layers=LAYERS, drafter=dev,
                       use_graph=device == "cuda")
    prompt = prompt_of(4)                          # 3 context rows: the window starts part-filled
    state0, feats, hidden = rt.prefill(prompt, LAYERS)
    ar = GraphedAR(rt, max_len=200, use_graph=False)    # the truth from the same state and ops
    ar.reset(state0, prompt[-1])
    truth = ar.decode(200)
    state.reset(state0, prompt[-1])
    dev.reset(prompt, feats, hidden)
    dev.propose(spec)                              # first chain, drafted eagerly
    host.reset(prompt, feats, hidden)
    rng = random.Random(5)
    root, pos, lengths, near_ties = prompt[-1], 0, [], 0
    for step in range(24):
        draft = host.propose(DraftContext(root, settings))
        device_chain = spec.tokens[0, 1:].tolist()
        gap = host_chain_gap(host, draft, device_chain)
        if gap is not None:
            assert gap < NEAR_TIE, f"step {step}: device chain {device_chain} != host {draft.tree.tokens[1:]}"
            near_ties += 1
        valid = int(dev.valid.sum())
        assert valid == len(host.ctx) and torch.allclose(dev.ctx[WINDOW - valid:], host.ctx, atol=1e-5)
        for (k, v), (hk, hv) in zip(dev.kv, host.ctx_kv):
            assert torch.allclose(k[WINDOW - valid:], hk, atol=1e-5)
            assert torch.allclose(v[WINDOW - valid:], hv, atol=1e-5)
        m = step % (S + 1) if step < S + 1 else rng.randrange(S + 1)
        scripted = truth[pos:pos + m] + [(truth[pos + m] + 1) % target.config.vocab_size]
        scripted += [(t + 7) % target.config.vocab_size for t in truth[pos + m + 1:pos + S]]
        spec.tokens[0, 1:] = torch.tensor(scripted[:S], device=device)
        spec.step()                                 # verify, accept, then the device draft
        a, _, bonus, *path = spec.result.tolist()
        assert a == m and bonus == truth[pos + m], f"step {step}: accepted {a}, scripted {m}"
        nodes = path[:a + 1]
        idx = torch.tensor(nodes, device=device)
        host.observe(Accepted(tokens=[root] + scripted[:a], features=spec.features.index_select(0, idx),
                              last_hidden=spec.last_hidden.index_select(0, idx), bonus_token=bonus))
        lengths.append(a)
        root, pos = bonus, pos + a + 1
    assert set(lengths) == set(range(S + 1))
    assert pos > 2 * WINDOW                         # the window wrapped more than once
    assert near_ties <= 2, f"{near_ties} near-tie flips: suspicious"
    assert state.output() == truth[:pos]


# --------------------------------------------------------------------------- decoding

def decode(dec: GraphedDecoder, prompt, n, prefilled=None):
    """(tokens, accepted lengths, steps) of a decode of at least n tokens."""
    steps = list(dec.steps(prompt, n, prefilled))
    tokens = [t for st in steps for t in [st.tree.tokens[i] for i in st.outcome.path[1:]] + [st.outcome.bonus]]
    return tokens, [st.outcome.accepted for st in steps], steps


@pytest.mark.parametrize("shape", ["chain", "beam", "best-first"])
@pytest.mark.parametrize("kind", KINDS)
def test_device_draft_decoder_equals_ar_greedy(kind, shape):
    target, drafter = pair(kind, vocab=16, seed=2)   # a small vocabulary: some drafts accepted
    rt = PackedTarget(target)
    n = 40
    settings = DraftSettings(tree=shape, block_size=BLOCK, top_k=3, budget=6 if shape == "chain" else 9)
    dec = GraphedDecoder(rt, DeviceBlockDrafter(drafter, settings), settings, capacity=n + 16, use_graph=False)
    accepted_any = False
    for seed in range(3):
        prompt = prompt_of(6 + 5 * seed, vocab=16, seed=seed)
        ref = ar_generate(target, prompt, DecodeSettings(max_new_tokens=n)).tokens
        tokens, accepted, steps = decode(dec, prompt, n)
        assert tokens[:n] == ref, f"prompt {seed}: device-drafted decoding left AR"
        assert n <= len(tokens) < n + BLOCK         # stops at the first step reaching n
        phases = [set(st.times_ms) - {"idle"} for st in steps]
        assert all(p == {"draft", "verify", "accept"} for p in phases) and "idle" in steps[0].times_ms
        accepted_any |= any(accepted)
    assert accepted_any, "no draft token was ever accepted: the test exercises rejections only"


def record_of(step) -> tuple:
    return step.tree.tokens, step.tree.parents, step.outcome, step.choice, step.target_prob, step.details


@pytest.mark.parametrize("max_batch", [1, 3])
def test_queued_batches_of_any_size_give_the_same_steps(max_batch, monkeypatch):
    """Steps queued in batches (each queued before the one before it is read back) give the
    same records whatever the batch size: trees, acceptance, the target's picks and the
    drafter's lattice rows, read back beside their own steps."""
    from specla.graphs import decoders

    target, drafter = pair("lilicorr", vocab=16, seed=2)
    rt = PackedTarget(target)
    settings = DraftSettings(tree="best-first", block_size=BLOCK, top_k=3, budget=9)
    prompt = prompt_of(8, vocab=16)

    def run():
        dec = GraphedDecoder(rt, DeviceBlockDrafter(drafter, settings), settings, capacity=56, use_graph=False)
        return decode(dec, prompt, 40)[2]

    want = run()
    monkeypatch.setattr(decoders, "MAX_BATCH", max_batch)
    got = run()
    assert [record_of(s) for s in got] == [record_of(s) for s in want]
    assert len(got) > 3 and all(len(s.details["lattice"]["chosen"]) == BLOCK - 1 for s in got)
    if max_batch == 1:      # every step is a batch of its own, so each carries the device's wait
        assert all(s.times_ms["idle"] >= 0 for s in got)


def test_queued_batches_stay_within_capacity_and_stop_at_n():
    """A decode as long as the decoder's capacity: no step is queued past the step log, and
    none is yielded after the one that reaches n (steps a batch ran past n stay unread)."""
    target, drafter = pair("block", vocab=16, seed=2)
    rt = PackedTarget(target)
    settings = chain_settings()
    n = 24
    dec = GraphedDecoder(rt, DeviceBlockDrafter(drafter, settings), settings, capacity=n, use_graph=False)
    for length in (5, 9):
        tokens, _, steps = decode(dec, prompt_of(length, vocab=16), n)
        queued = int(dec.state.step.item())
        assert len(steps) <= queued <= dec.state.log.steps - 1
        assert len(tokens) - (steps[-1].outcome.accepted + 1) < n <= len(tokens)


# a preset with branches at depths 1 to 3 and ranks up to 2
PRESET = [[0], [1], [0, 0], [0, 1], [1, 0], [2], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def test_device_preset_equals_the_host_preset_and_ar():
    """A tree preset drafted on the device from the block drafter's slot candidates: the same
    fixed tree each step, its tokens those the host's `PresetShape` proposes, decoding equal
    to AR greedy, and some step accepting a node off the first children."""
    import copy

    from specla.decode import speculative_steps
    from specla.runner import PresetShape
    target, drafter = pair("block", vocab=16, seed=2)
    rt = PackedTarget(target)
    n = 40
    settings = DraftSettings(tree="chain", block_size=BLOCK, top_k=2, budget=4)
    dev = DeviceBlockDrafter(drafter, settings, preset=PRESET)
    assert not dev.dynamic and dev.nodes == len(PRESET) + 1 and dev.top_k == 3 and dev.max_depth == 4
    assert dev.template().to_index_paths() == PRESET
    dec = GraphedDecoder(rt, dev, settings, capacity=n + 16, use_graph=False)
    prompt = prompt_of(9, vocab=16, seed=1)
    ref = ar_generate(target, prompt, DecodeSettings(max_new_tokens=n)).tokens
    tokens, accepted, steps = decode(dec, prompt, n)
    assert tokens[:n] == ref, "device-drafted preset decoding left AR"
    host = list(speculative_steps(target, PresetShape(copy.copy(drafter), PRESET), prompt,
                                  DecodeSettings(max_new_tokens=n), settings))
    assert [h.tree.parents for h in host] == [st.tree.parents for st in steps][:len(host)]
    assert [h.tree.tokens for h in host] == [st.tree.tokens for st in steps][:len(host)]
    first = {kids[0] for kids in steps[0].tree.children if kids}
    assert any(set(st.outcome.path[1:]) - first for st in steps), "no step accepted a node off the first children"
    with pytest.raises(ValueError, match="depend on the path"):
        DeviceBlockDrafter(pair("lilicorr")[1], settings, preset=PRESET)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_block_draft_equals_the_uncompiled_one_on_cpu():
    """`compile=True` (what the GPU uses to fuse the draft's ~300 kernels and the acceptance's
    ~70) runs the same math:
    on the CPU (inductor's C++ backend) the decode equals AR and drafts exactly the chains the
    uncompiled drafter drafts, so the accept lengths agree step for step. Each compiled
    function is one graph: a break would split the draft into more, separately launched
    kernels."""
    from torch._dynamo.utils import counters

    target, drafter = pair("block", vocab=16, seed=2)
    rt = PackedTarget(target)
    n = 32
    prompt = prompt_of(11, vocab=16, seed=1)
    ref = ar_generate(target, prompt, DecodeSettings(max_new_tokens=n)).tokens
    runs = {}
    counters.clear()
    for compiled in (False, True):
        dev = DeviceBlockDrafter(drafter, chain_settings(), compile=compiled)
        dec = GraphedDecoder(rt, dev, chain_settings(), capacity=n + 16, use_graph=False)
        tokens, accepted, _ = decode(dec, prompt, n)
        assert tokens[:n] == ref
        runs[compiled] = accepted
        assert dec.spec.compiled == compiled      # the acceptance phase is compiled with the draft
    assert dev.compiled and any(runs[True])
    assert runs[True] == runs[False]
    assert not counters["graph_break"], list(counters["graph_break"])


def test_divergence_is_located_and_measured():
    """Where an output leaves AR's, the engine reports the position, both tokens and the
    target's positive logit gap between AR's pick and the output's token there."""
    target, _ = pair("block")
    n, prompt = 24, prompt_of(8)
    ref = ar_generate(target, prompt, DecodeSettings(max_new_tokens=n)).tokens
    bad = list(ref)
    bad[13] = (bad[13] + 1) % 128
    for engine in (Engine(target, "eager"), Engine(target, "graphed", use_graph=False)):
        d = engine.divergence(prompt, bad, 13, ref[13])
        assert d["position"] == 13 and d["token"] == bad[13] and d["ar_token"] == ref[13]
        assert d["logit_gap"] > 0 and d["top2_gap"] >= 0


def test_phase_split_covers_the_three_phases():
    target, drafter = pair("lilicorr")
    rt = PackedTarget(target)
    settings = chain_settings()
    dec = GraphedDecoder(rt, DeviceBlockDrafter(drafter, settings), settings, capacity=40, use_graph=False)
    prompt = prompt_of(8)
    tokens, accepted, steps = decode(dec, prompt, 16)
    assert all(v > 0 for st in steps for v in st.times_ms.values())
    from specla.graphs.spec import phase_times
    dec.start(prompt)
    dec.drafter.propose(dec.spec)
    split = phase_times(dec.spec, len(steps))
    assert set(split) == {"verify", "accept_commit", "draft"} and all(v > 0 for v in split.values())
    assert dec.state.output() == tokens             # the phases replay the same trajectory


# --------------------------------------------------------------------------- CUDA graphs

def first_mismatch(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def gap_at(rt, prompt, tokens, i, want):
    """AR's logit gap between its own token and the output's at position i (0 if equal)."""
    ar = GraphedAR(rt, max_len=len(tokens) + 8)
    row = ar.logits_along(rt.prefill(prompt)[0], prompt[-1], tokens[:i])[-1]
    return float(row[want[i]] - row[tokens[i]])


def graphed_and_eager(rt, drafter, settings, prompt, n, want, noise=0.0, preset=None):
    """The same decode graphed and eager (both on the GPU), each against AR's tokens `want`:
    equal to them, or leaving them only at a near-tie (gap <= 3 x noise; fp32: noise 0, so
    any divergence fails). Graph replays reproduce themselves. Returns both (tokens, accepted)."""
    pre = rt.prefill(prompt, drafter.feature_layers)
    runs = {}
    for graphed in (True, False):
        dec = GraphedDecoder(rt, DeviceBlockDrafter(drafter, settings, preset=preset), settings, capacity=n + 16,
                             use_graph=graphed)
        # a chain verified in one launch accepts in it too: its acceptance has nothing to capture
        phases = {"verify", "draft"} | (set() if dec.spec.kernel_accept else {"accept"})
        assert preset is None or dec.spec.kernel_accept, dec.spec.verify_note
        assert (dec.first_graph is not None and set(dec.spec.graphs) == phases) == graphed
        tokens, accepted, _ = decode(dec, prompt, n, pre)
        i = first_mismatch(tokens, want[:n])
        if i is not None:
            gap = gap_at(rt, prompt, tokens, i, want)
            assert gap <= 3 * noise + 1e-6, \
                f"{'graphed' if graphed else 'eager'} run left AR at {i} beyond noise {noise:.4f}: gap {gap}"
        if graphed:
            again = decode(dec, prompt, n, pre)
            assert again[0] == tokens and again[1] == accepted, "replays differ"
        runs[graphed] = (tokens, accepted, i)
    j = first_mismatch(runs[True][0], runs[False][0])
    if j is not None:   # graph and eager may part only after an (excused) near-tie flip
        for tokens, _, i in runs.values():
            assert i is not None and i <= j, (i, j)
    else:
        assert runs[True][1] == runs[False][1]
    return runs[True], runs[False]


def _small_cuda_pair(kind: str, shape: str = "chain"):
    """A random fp32 target at the GPU tests' small shape, a random drafter of `kind`, the
    runtime, a GraphedAR, draft settings and a prompt."""
    from tests.test_gpu_runtime import SMALL

    target = random_gdn(SMALL, "cuda", torch.float32, seed=0)
    torch.manual_seed(1)
    kw = dict(width=64, heads=2, mlp_hidden=128, window=16)
    if kind == "lilicorr":
        kw["head"] = dict(width=32, heads=2, mlp_hidden=64)
    drafter = new_drafter(kind, target, feature_layers=(0, 2), block_size=8, top_k=4, **kw)
    rt = PackedTarget(target)
    ar = GraphedAR(rt, max_len=128)
    settings = DraftSettings(tree=shape, block_size=8, top_k=4, budget=7 if shape == "chain" else 12)
    return drafter, rt, ar, settings, prompt_of(40, SMALL.vocab_size)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["chain", "best-first"])
@pytest.mark.parametrize("kind", KINDS)
def test_graphed_device_drafter_fp32_equals_graphed_ar_and_eager(kind, shape):
    drafter, rt, ar, settings, prompt = _small_cuda_pair(kind, shape)
    n = 64
    ar.reset(rt.prefill(prompt)[0], prompt[-1])
    want = ar.decode(n)
    graphed, eager = graphed_and_eager(rt, drafter, settings, prompt, n, want)
    assert graphed[0][:n] == want and graphed[2] is None
    assert graphed[0] == eager[0]


@needs_cuda
@pytest.mark.gpu
def test_graphed_preset_fp32_equals_graphed_ar_and_eager():
    """A tree preset on the GPU: drafted by the persistent draft kernel, verified and accepted
    in the persistent verification's launch, equal to AR in fp32, graphed and eager."""
    drafter, rt, ar, settings, prompt = _small_cuda_pair("block")
    n = 64
    ar.reset(rt.prefill(prompt)[0], prompt[-1])
    want = ar.decode(n)
    dev = DeviceBlockDrafter(drafter, settings, preset=PRESET)
    assert dev.kernel_chain, dev.draft_note
    graphed, eager = graphed_and_eager(rt, drafter, settings, prompt, n, want, preset=PRESET)
    assert graphed[0][:n] == want and graphed[2] is None
    assert graphed[0] == eager[0]


def _embedded_pair():
    target_dir, drafters_dir = ROOT / "assets" / "target", ROOT / "assets" / "drafters"
    missing = [p for p in (target_dir / "config.json", drafters_dir / "lilicorr" / "drafter.json",
                           drafters_dir / "block" / "drafter.json") if not p.exists()]
    if missing:
        pytest.skip(f"trained assets absent: {', '.join(str(p.relative_to(ROOT)) for p in missing)}")
    from specla.acceptance import read_prompts
    from specla.checkpoint import load_model
    from specla.drafters import load_drafter

    target, tokenizer, _ = load_model(target_dir, device="cuda", dtype=torch.bfloat16)
    drafters = {kind: load_drafter(drafters_dir / kind, target) for kind in KINDS}
    texts = read_prompts(ROOT / "examples" / "prompts.jsonl", 3)
    return target, drafters, [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_trained_pair_bf16_graphed(kind):
    """The embedded target + trained drafter, bf16, graphed: the output leaves GraphedAR only
    at bf16 near-ties, graph = eager up to such a flip, and the trained drafter gets drafts
    accepted (tau well above 1)."""
    target, drafters, prompts = _embedded_pair()
    drafter = drafters[kind]
    rt = PackedTarget(target)
    ar = GraphedAR(rt, max_len=256)
    block = drafter.net.config.block_size
    settings = DraftSettings(tree="chain", block_size=block, top_k=4, budget=block - 1)
    n, tokens, steps = 96, 0, 0
    for prompt in prompts:
        state0 = rt.prefill(prompt)[0]
        ar.reset(state0, prompt[-1])
        want = ar.decode(n + 16)
        noise = spec_vs_ar_noise(rt, ar, state0, prompt[-1], want)
        graphed, _ = graphed_and_eager(rt, drafter, settings, prompt, n, want, noise)
        tokens, steps = tokens + len(graphed[0]), steps + len(graphed[1])
    assert tokens / steps > 1.4, f"tau {tokens / steps:.2f}: the trained {kind} drafter barely drafts"


def _decoders_agree(kind: str, option: str, shape: str = "chain") -> DeviceBlockDrafter:
    """Decode with the device drafter, `option` off and on: both exactly AR (the target picks
    every token) and, in fp32, the same accept lengths. Returns the drafter with it on."""
    drafter, rt, ar, settings, prompt = _small_cuda_pair(kind, shape)
    n = 64
    pre = rt.prefill(prompt, tuple(drafter.feature_layers))
    ar.reset(pre[0], prompt[-1])
    want = ar.decode(n)
    runs = {}
    for on in (False, True):
        dev = DeviceBlockDrafter(drafter, settings, **{option: on})
        dec = GraphedDecoder(rt, dev, settings, capacity=n + 16)
        tokens, accepted, _ = decode(dec, prompt, n, pre)
        assert tokens[:n] == want, f"{option}={on} left AR"
        runs[on] = accepted
    assert runs[True] == runs[False]
    return dev


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_device_drafter_graphed_equals_graphed_ar(kind):
    """torch.compile'd drafting captured in the step graph: the same chains as the
    uncompiled drafter up to fused-kernel rounding."""
    assert _decoders_agree(kind, "compile").compiled


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_persistent_draft_decoder_equals_torch_path(kind):
    """The draft as one persistent launch (kernels/triton_draft_step.py) inside the step graph:
    (fp32) exactly AR, and the same accept lengths as the torch path's drafts."""
    dev = _decoders_agree(kind, "persistent")
    assert dev.kernel is not None and dev.draft_note == "one persistent launch"


@needs_cuda
@pytest.mark.gpu
def test_persistent_best_first_tree_decoder_equals_torch_path():
    """The block drafter's best-first tree grown in the persistent draft's launch: (fp32)
    exactly AR, and the same accept lengths as the trees grown by torch ops."""
    dev = _decoders_agree("block", "persistent", "best-first")
    assert dev.kernel_tree and "best-first tree in the same launch" in dev.draft_note, dev.draft_note


@needs_cuda
@pytest.mark.gpu
def test_lilicorr_best_first_tree_kernel_equals_torch_path():
    """LiLiCorr's best-first tree (rows conditional on the parent) grown in one launch after
    the head: (fp32) exactly AR, and the same accept lengths as `grow_tree`'s torch ops."""
    dev = _decoders_agree("lilicorr", "tree_kernel", "best-first")
    assert dev.lattice_tree and "LiLiCorr's best-first tree in one launch" in dev.draft_note, dev.draft_note


@needs_cuda
@pytest.mark.gpu
def test_kernel_tree_with_torch_acceptance_equals_ar(monkeypatch):
    """The kernel's best-first tree accepted by torch ops (which read the whole topology,
    rebuilt from the kernel's parents): (fp32) exactly AR, graphed and eager."""
    import specla.graphs.whole_step as whole_step
    monkeypatch.setattr(whole_step, "FUSED_ACCEPT", False)
    drafter, rt, ar, settings, prompt = _small_cuda_pair("block", "best-first")
    n = 64
    ar.reset(rt.prefill(prompt)[0], prompt[-1])
    want = ar.decode(n)
    assert DeviceBlockDrafter(drafter, settings).kernel_tree
    graphed, eager = graphed_and_eager(rt, drafter, settings, prompt, n, want)
    assert graphed[0][:n] == want and graphed[0] == eager[0]


@needs_cuda
@pytest.mark.gpu
def test_fused_head_decoder_equals_torch_head():
    """The LiLiCorr head as Triton kernels inside the step graph: (fp32, tf32x3 products) the
    same chains as the torch head."""
    assert _decoders_agree("lilicorr", "fused_head").fused_head is not None


@pytest.mark.parametrize("device", DEVICES)
def test_block_top_k_is_one_kernel_on_cuda_and_equals_torch(device):
    """The block drafter's slot top-k: Triton's `lattice_topk` on CUDA (unless the fused
    kernels are turned off), torch's log_softmax + topk elsewhere; the same candidates."""
    from specla.drafters.lilicorr import candidates

    target, drafter = pair("block", device)
    dev = DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK, top_k=4))
    assert (dev.topk is candidates) == (device == "cpu")
    assert DeviceBlockDrafter(drafter, DraftSettings(block_size=BLOCK), fused_head=False).topk is candidates
    rt = PackedTarget(target)
    prompt = prompt_of(9)
    _, feats, _ = rt.prefill(prompt, LAYERS)
    dev.reset(prompt, feats, None)
    logits = dev.slot_logits(torch.tensor([prompt[-1]], device=device))[1][0]
    cand, logp = dev.topk(logits, 4)
    want_cand, want_logp = candidates(logits, 4)
    assert cand.shape == (BLOCK - 1, 4) and torch.equal(cand, want_cand)
    assert torch.allclose(logp, want_logp, atol=1e-4)


def test_every_device_drafter_is_built_with_compile():
    """compile=True sets up each kind's device drafter (its functions are traced lazily, at
    their first call, but what runs when it is built must fit every kind), with every packed
    projection weight built first, so no traced graph concatenates weights."""
    from specla.drafters import model_free_drafter
    from specla.graphs.drafters import device_drafter_for

    target, block = pair("block")
    torch.manual_seed(0)
    eagle = new_drafter("eagle", target, top_k=2, heads=2, mlp_hidden=32, window=8)
    for drafter in (block, pair("lilicorr")[1], eagle, model_free_drafter("ngram", target)):
        dev, why = device_drafter_for(drafter, chain_settings(), compile=True)
        assert why is None and dev.compiled, (type(drafter).__name__, why)
        packing = [m for m in getattr(drafter, "net", torch.nn.Module()).modules() if hasattr(m, "PACKS")]
        assert all("_cache_" + name in m.__dict__ for m in packing for name in m.PACKS)
        assert packing or drafter.kind == "ngram"      # the model-free drafter has no weights


@needs_cuda
@pytest.mark.gpu
def test_the_page_defaults_run_the_measured_preset_on_the_device():
    """What a page on a GPU starts with (`runner.default_drafter` and `runner.default_preset`), through
    the service layer the page's Run calls: the block drafter's measured preset, drafted,
    verified and accepted on the device, bf16 output equal to AR or leaving it at a near-tie."""
    _embedded_pair()                                    # skips without the trained assets
    from specla import runner
    rt = runner.load_runtime(device="cuda")
    drafter = runner.default_drafter(rt)
    settings = {"drafter": drafter, "paths": runner.default_preset(rt, drafter), "max_new_tokens": 64}
    assert drafter == "block" and settings["paths"] == runner.MEASURED
    trace = [t for t in runner.run(rt, "def add(a, b):\n    return", settings) if isinstance(t, dict)][-1]
    assert trace["settings"]["paths"] == runner.measured_preset(rt.drafters["block"], "block")
    engine = trace["engine"]
    assert engine["backend"] == "graphed" and engine["drafting"] == "device" and engine["acceptance"] == "device"
    assert "one persistent launch" in str(engine.get("verification")), engine
    exact = trace["exactness"]
    assert exact["equal"] or exact["first_divergence"]["near_tie"], exact
    assert trace["summary"]["new_tokens"] == 64
