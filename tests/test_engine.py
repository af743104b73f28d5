"""Speculative decoding equals AR decoding: tokens, states, and sampled distributions."""
import itertools
import math
import random

import pytest
import torch
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

from specla.accept import accept_greedy, target_distribution
from specla.decode import DecodeSettings, ar_generate, prefill, replay_state, speculative_steps
from specla.drafters.base import Draft, DraftSettings
from specla.drafters.oracle import OracleDrafter
from specla.model import Topology, commit
from specla.tree import DraftTree, TreeError
from tests.helpers import random_target

TARGETS = {
    "small": dict(),
    "wide-heads": dict(vocab=200, hidden=96, layers=3, heads=3, head_dim=32, expand_v=1.0, seed=3),
}


def processed_tokens(prompt, records):
    """Tokens the state has absorbed after the run: prompt + every emitted token but the last
    bonus (that one is the next root, not yet fed)."""
    stream = [t for r in records for t in r.acceptance.tokens + [r.acceptance.bonus]]
    return prompt + stream[:-1]


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("shape,mode", [("chain", "chain"), ("chain", "tree"), ("chain", "auto"),
                                        ("tree", "tree"), ("tree", "hybrid"),
                                        ("random", "tree"), ("random", "hybrid"), ("random", "auto")])
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_greedy_speculation_equals_ar(target_name, shape, mode, deferred):
    target = random_target(**TARGETS[target_name])
    vocab = target.config.vocab_size
    rng = random.Random(hash((target_name, shape, mode, deferred)) % 1000)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    settings = DecodeSettings(max_new_tokens=32, mode=mode, deferred=deferred)
    ar = ar_generate(target, prompt, settings)
    for alpha, budget, width in ((0.9, 12, 3), (0.5, 6, 2), (1.0, 20, 4)):
        drafter = OracleDrafter(ar.tokens + [0] * 64, vocab, alpha=alpha, shape=shape, seed=budget)
        final = []
        records = list(speculative_steps(target, drafter, prompt, settings,
                                         DraftSettings(budget=budget, top_k=width), state_out=final))
        tokens = [t for r in records for t in r.new_tokens]
        assert tokens == ar.tokens
        assert len(records) < len(tokens) or alpha < 1   # perfect drafts must save forwards
        replay = replay_state(target, processed_tokens(prompt, records))
        # fp32 rounding: projections of N tokens at once round differently from one at a time.
        torch.testing.assert_close(final[0].recurrent, replay.recurrent, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[0].conv, replay.conv, rtol=1e-4, atol=1e-4)


def test_prefill_then_decode_equals_longer_prefill():
    target = random_target()
    tokens = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    n, m = 21, 9
    whole = target(torch.tensor([tokens]), target.new_state(), Topology.chain(30, 4), mode="tree")
    state = target.new_state()
    part = target(torch.tensor([tokens[:n]]), state, Topology.chain(n, 4), mode="tree")
    commit(state, part.factors, list(range(n)))
    for i in range(n, n + m):
        out = target(torch.tensor([[tokens[i]]]), state, Topology.chain(1, 4), mode="chain")
        torch.testing.assert_close(out.logits[0, 0], whole.logits[0, i], rtol=1e-4, atol=1e-4)
        commit(state, out.factors, [0])
    full_state = target.new_state()
    commit(full_state, whole.factors, list(range(n + m)))
    torch.testing.assert_close(state.recurrent, full_state.recurrent, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.conv, full_state.conv, rtol=1e-4, atol=1e-4)


def test_every_layer_matches_fla_naive_recurrence():
    """Per layer: our verify outputs and committed state equal fla's naive recurrence."""
    target = random_target(layers=3)
    tokens = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(2))
    state = target.new_state()
    topo = Topology.chain(17, 4)
    x = target.model.embeddings(tokens)
    with torch.no_grad():
        for l, block in enumerate(target.model.layers):
            h = block.attn_norm(x)
            q, k, v, g, beta, _, gate = block.attn.qkv_gates(h, state.conv[l], topo)
            o_ref, S_ref = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=1.0,
                                                            initial_state=state.recurrent[l],
                                                            output_final_state=True)
            from specla.verify import verify_layer
            o, delta = verify_layer("tree", q, k, v, g, beta, state.recurrent[l].clone(), topo)
            torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
            from kernels.reference import commit_ref
            torch.testing.assert_close(commit_ref(state.recurrent[l], k, delta, g), S_ref,
                                       rtol=1e-5, atol=1e-5)
            x = x + block.attn.output(o, h, gate)
            x = x + block.mlp(block.mlp_norm(x))


@torch.inference_mode()
def test_rejected_branches_leave_no_trace_in_the_state():
    target = random_target()
    prompt = [3, 1, 4, 1, 5]
    state, _, _ = prefill(target, prompt)
    before = state.clone()
    tree = DraftTree([5, 9, 2, 6, 5, 3], [-1, 0, 1, 0, 3, 3])
    out = target(torch.tensor([tree.tokens]), state, target.topology(tree), mode="tree")
    torch.testing.assert_close(state.recurrent, before.recurrent, rtol=0, atol=0)  # not written
    acc = accept_greedy(tree, out.logits[0])
    commit(state, out.factors, acc.path)
    replay = replay_state(target, prompt[:-1] + [tree.tokens[n] for n in acc.path])
    torch.testing.assert_close(state.recurrent, replay.recurrent, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [
    dict(tokens=[], parents=[]),
    dict(tokens=[1, 2, 3], parents=[-1, 2, 0]),
    dict(tokens=[1, 2], parents=[-1, 1]),
    dict(tokens=[1, 2], parents=[0, -1]),
    dict(tokens=list(range(300)), parents=list(range(-1, 299))),
], ids=["empty", "parent-after-child", "cycle", "root-not-first", "over-budget"])
def test_malformed_trees_are_refused(bad):
    with pytest.raises(TreeError):
        DraftTree(**bad)


def test_index_paths_round_trip():
    tree = DraftTree.from_index_paths([[0], [1], [0, 0], [0, 1], [1, 0]], [7, 1, 2, 3, 4, 5])
    assert tree.parents == [-1, 0, 0, 1, 1, 2]
    assert tree.to_index_paths() == [[0], [1], [0, 0], [0, 1], [1, 0]]
    assert sorted(tree.to_networkx().edges) == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5)]
    with pytest.raises(TreeError):
        DraftTree.from_index_paths([[0, 0]], [1, 2])


def test_chain_mode_refuses_a_tree():
    target = random_target()
    tree = DraftTree([1, 2, 3], [-1, 0, 0])
    with pytest.raises(ValueError, match="chain"):
        target(torch.tensor([tree.tokens]), target.new_state(), target.topology(tree), mode="chain")


# ----- sampling: the output distribution equals the target's ---------------------------------

class SampledChainDrafter:
    """Draws a chain from a fixed random proposal q and reports q (the q/p rejection path)."""
    name, feature_layers = "sampled-chain", ()

    def __init__(self, vocab, depth, seed):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
        self.depth = depth

    def reset(self, *args):
        pass

    def observe(self, accepted):
        pass

    def propose(self, ctx):
        tokens = [ctx.root_token] + torch.multinomial(self.q, self.depth, replacement=True,
                                                      generator=ctx.generator).tolist()
        proposal = self.q.expand(len(tokens), -1).clone()
        return Draft(DraftTree.chain(tokens), proposal=proposal)


@torch.inference_mode()
def exact_two_token_distribution(target, prompt, temperature):
    state, _, _ = prefill(target, prompt)
    out = target(torch.tensor([[prompt[-1]]]), state, Topology.chain(1, 4), mode="chain")
    p1 = target_distribution(out.logits[0, 0], temperature)
    commit(state, out.factors, [0])
    V = p1.numel()
    joint = torch.zeros(V, V)
    for a in range(V):
        s = state.clone()
        o = target(torch.tensor([[a]]), s, Topology.chain(1, 4), mode="chain")
        joint[a] = p1[a] * target_distribution(o.logits[0, 0], temperature)
    return joint.flatten()


def chi2_critical(df, z=3.29):  # Wilson-Hilferty, upper 0.9995 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("drafter_kind", ["oracle-tree", "sampled-chain"])
def test_sampling_follows_the_target_distribution(drafter_kind):
    target = random_target(vocab=6, hidden=32, heads=2, head_dim=8, std=0.6, seed=5)
    prompt, temperature, n = [1, 2, 3], 1.0, 1500
    expected = exact_two_token_distribution(target, prompt, temperature)
    counts = torch.zeros_like(expected)
    for seed in range(n):
        if drafter_kind == "oracle-tree":
            drafter = OracleDrafter([0, 1, 2, 3, 4, 5] * 4, 6, alpha=0.5, shape="tree", seed=seed)
            ds = DraftSettings(budget=4, top_k=2)
        else:
            drafter = SampledChainDrafter(6, depth=3, seed=11)
            ds = DraftSettings(budget=3)
        settings = DecodeSettings(max_new_tokens=2, temperature=temperature, seed=seed, mode="tree")
        tokens = [t for r in speculative_steps(target, drafter, prompt, settings, ds) for t in r.new_tokens]
        counts[tokens[0] * 6 + tokens[1]] += 1
    keep = expected * n >= 5           # pool the rare cells, as the chi-square test requires
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep] * n, (expected[~keep].sum() * n).view(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    df = int(keep.sum())
    assert chi2 < chi2_critical(df), f"chi2={chi2:.1f} over {df} dof"
