"""Drafters, the LiLiCorr head, tree building, checkpoints and drafter training (CPU, tiny target)."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.config import GDNConfig
from specla.drafters import (DRAFTERS, DrafterFormatError, fingerprint_of, load_drafter, new_drafter,
                             save_drafter)
from specla.drafters import tree_build
from specla.drafters.base import Accepted, DraftContext, DraftSettings
from specla.drafters.lilicorr import (HeadConfig, LiLiCorrHead, greedy_walk, lattice_losses,
                                      sampled_walk, tree_rows)
from specla.model import GDNForCausalLM, Topology


@pytest.fixture(scope="module", autouse=True)
def cpu_settings():
    """Tiny models: one thread (no thrashing on a shared 2-core machine) and flushed denormals
    (CPU training slows ~20x once weights/grads go denormal); both restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)

TINY = GDNConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                 expand_v=1.0, intermediate_size=64)
SMALL = {"block": dict(width=32, heads=2, mlp_hidden=64, window=8),
         "lilicorr": dict(width=32, heads=2, mlp_hidden=64, window=8, head=dict(width=32, heads=2, mlp_hidden=64)),
         "eagle": dict(heads=2, mlp_hidden=64, window=8)}
LAYERS = (0, 1)


def tiny_target(seed: int = 0) -> GDNForCausalLM:
    torch.manual_seed(seed)
    model = GDNForCausalLM(TINY).eval()
    with torch.no_grad():  # a peakier target than random init, so drafting has something to learn
        model.lm_head.weight.mul_(6)
    return model


def tiny_drafter(kind: str, target, seed: int = 1, top_k: int = 4):
    torch.manual_seed(seed)
    return new_drafter(kind, target, feature_layers=LAYERS, block_size=6, top_k=top_k, **SMALL[kind])


def target_pass(target, tokens: list[int]):
    """Features and last hidden of every position of `tokens` (one chain forward)."""
    t = torch.tensor([tokens])
    with torch.no_grad():
        out = target(t, target.new_state(1), Topology.chain(len(tokens), TINY.conv_size),
                     mode="chain", feature_layers=LAYERS)
    return out.features[0], out.last_hidden[0], out.logits[0]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, TINY.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()


def started(kind, target, prompt, **kw):
    drafter = tiny_drafter(kind, target, **kw)
    feats, hidden, _ = target_pass(target, prompt[:-1])
    drafter.reset(prompt, feats, hidden)
    return drafter


def ctx(prompt, **settings) -> DraftContext:
    return DraftContext(prompt[-1], DraftSettings(**{"block_size": 6, **settings}),
                        torch.Generator().manual_seed(7))


# ---------------------------------------------------------------- LiLiCorr head

def random_head(S=4, k=3, N=2, seed=0):
    torch.manual_seed(seed)
    head = LiLiCorrHead(HeadConfig(drafter_width=16, target_hidden=24, width=32, heads=2,
                                   mlp_hidden=32, max_slots=6, max_k=4))
    logp = torch.log_softmax(torch.randn(N, S, 10), -1).topk(k, -1).values
    inputs = (torch.randn(N, S, k, 24), logp, torch.randn(N, S, 16), torch.randn(N, 16))
    return head, inputs


def test_pair_scores_equal_direct_per_pair_computation():
    head, inputs = random_head()
    start, pair = head(*inputs)
    Fx, a = head.fused(*inputs)
    N, S, k = Fx.shape[:3]
    assert pair.shape == (N, S - 1, k, k) and start.shape == (N, k)
    for n, s, i, j in itertools.product(range(N), range(S - 1), range(k), range(k)):
        out = F.normalize(head.w_out(Fx[n, s, i]), dim=-1)
        inn = F.normalize(head.w_in(Fx[n, s + 1, j]), dim=-1)
        assert torch.allclose(pair[n, s, i, j], 8 * (out @ inn), atol=1e-5)
    for n, j in itertools.product(range(N), range(k)):
        direct = 8 * F.normalize(head.w_a(a[n]), dim=-1) @ F.normalize(head.w_in(Fx[n, 0, j]), dim=-1)
        assert torch.allclose(start[n, j], direct, atol=1e-5)


def test_greedy_walk_follows_the_argmax_rows():
    torch.manual_seed(0)
    start, pair = torch.randn(3, 5), torch.randn(3, 4, 5, 5)
    ranks = greedy_walk(start, pair)
    for n in range(3):
        assert ranks[n, 0] == start[n].argmax()
        for s in range(4):
            assert ranks[n, s + 1] == pair[n, s, ranks[n, s]].argmax()


def test_lilicorr_chain_is_the_greedy_walk(target, prompt):
    drafter = started("lilicorr", target, prompt)
    draft = drafter.propose(ctx(prompt, tree="chain", top_k=3, budget=16))
    lat = draft.details["lattice"]
    S = 5
    assert len(lat["candidates"]) == S and len(lat["pair"]) == S - 1 and len(lat["start"]) == 3
    chosen = greedy_walk(torch.tensor(lat["start"]), torch.tensor(lat["pair"])).tolist()
    assert lat["chosen"] == chosen and lat["top1"] == [0] * S
    assert draft.tree.tokens[1:] == [lat["candidates"][s][chosen[s]] for s in range(S)]
    assert draft.tree.is_chain and draft.proposal is None
    json.dumps(draft.details)  # JSON-able for the views


def test_tree_rows_hand_worked_example():
    """The example in tree_rows' docstring."""
    cand_logp = torch.tensor([[0.6, 0.2], [0.3, 0.3]]).log()
    start, pair = torch.tensor([0.0, math.log(3)]), torch.tensor([[[0.0, 0.0], [math.log(4), 0.0]]])
    root, below = tree_rows(start, pair, cand_logp, sharpness=1.0)
    assert torch.allclose(root.exp(), torch.tensor([0.2, 0.6]))
    assert torch.allclose(below.exp(), torch.tensor([[[0.3, 0.3], [0.48, 0.12]]]))


@pytest.mark.parametrize("sharpness", [0.5, 0.75, 1.0, 2.0])
def test_tree_rows_keep_the_drafter_mass_and_the_head_order(sharpness):
    torch.manual_seed(0)
    S, k = 5, 4
    start, pair = torch.randn(k) * 3, torch.randn(S - 1, k, k) * 3
    cand_logp = torch.log_softmax(torch.randn(S, 20), -1).topk(k, -1).values
    mass = torch.logsumexp(cand_logp, -1)
    root, below = tree_rows(start, pair, cand_logp, sharpness)
    assert torch.allclose(torch.logsumexp(root, -1), mass[0], atol=1e-5)
    assert torch.allclose(torch.logsumexp(below, -1), mass[1:, None].expand(S - 1, k), atol=1e-5)
    assert torch.equal(root.argsort(), start.argsort())         # the head's order: the chain is its walk
    assert torch.equal(below.argsort(-1), pair.argsort(-1))
    with pytest.raises(ValueError, match="sharpness must be > 0"):
        tree_rows(start, pair, cand_logp, 0.0)


def test_lilicorr_tree_nodes_carry_their_tree_rows(target, prompt):
    lili = started("lilicorr", target, prompt)
    draft = lili.propose(ctx(prompt, tree="best-first", top_k=3, budget=10))
    lat, tree = draft.details["lattice"], draft.tree
    root, below = tree_rows(torch.tensor(lat["start"]), torch.tensor(lat["pair"]),
                            torch.tensor(lat["logprobs"]), lili.tree_sharpness)
    rank = [None] + [lat["candidates"][tree.depths[i] - 1].index(tree.tokens[i]) for i in range(1, len(tree))]
    for i in range(1, len(tree)):
        d, parent = tree.depths[i], tree.parents[i]
        want = root[rank[i]] if d == 1 else below[d - 2, rank[parent], rank[i]]
        assert tree.logprobs[i] == pytest.approx(float(want), abs=1e-5)


def test_sampled_walk_q_is_a_distribution_on_the_candidates(target, prompt):
    drafter = started("lilicorr", target, prompt)
    draft = drafter.propose(ctx(prompt, tree="chain", top_k=3, temperature=0.8))
    q, lat = draft.proposal, draft.details["lattice"]
    assert q is not None and q.shape == (len(draft.tree), TINY.vocab_size)
    assert torch.all(q[0] == 0)
    for node in range(1, len(draft.tree)):
        slot = draft.tree.depths[node] - 1
        support = set(torch.nonzero(q[node]).flatten().tolist())
        assert support <= set(lat["candidates"][slot])
        assert math.isclose(float(q[node].sum()), 1.0, rel_tol=1e-5)
        assert q[node, draft.tree.tokens[node]] > 0
        assert lat["candidates"][slot][lat["chosen"][slot]] == draft.tree.tokens[node]
    # the walk itself: each pick's q row is the softmax of the row out of the previous pick
    start, pair = torch.randn(4), torch.randn(2, 4, 4)
    ranks, qs = sampled_walk(start, pair, 0.5, torch.Generator().manual_seed(0))
    assert torch.allclose(qs[0], torch.softmax(start / 0.5, -1))
    assert torch.allclose(qs[2], torch.softmax(pair[1, ranks[1]] / 0.5, -1))


def test_lattice_loss_masks_slots_after_the_true_token_leaves():
    torch.manual_seed(0)
    N, S, k = 1, 4, 3
    cand = torch.tensor([[[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]])
    true = torch.tensor([[6, 10, 99, 14]])      # in the lattice at slots 0, 1; gone at 2
    start = torch.randn(N, k, requires_grad=True)
    pair = torch.randn(N, S - 1, k, k, requires_grad=True)
    out = lattice_losses(start, pair, cand, true, torch.randn(N, S, 128))
    expected = (F.cross_entropy(start, torch.tensor([1])) +
                F.cross_entropy(pair[:, 0, 1], torch.tensor([2]))) / 2
    assert torch.allclose(out["lattice_ce"], expected)
    (out["lattice_ce"] + out["penalty"]).backward()
    assert torch.all(pair.grad[:, 2] == 0)      # slot 3 is past the break: no signal
    assert torch.all(pair.grad[:, 1, [0, 1]] == 0)  # slot 2: only the true parent's row (penalty)
    assert pair.grad[:, 0, 1].abs().sum() > 0 and torch.all(pair.grad[:, 0, [0, 2]] == 0)
    assert float(out["oracle_prefix"]) == 2


def test_penalty_is_zero_when_the_head_picks_the_best_target_token():
    cand = torch.tensor([[[1, 2]]])
    true = torch.tensor([[1]])
    z = torch.zeros(1, 1, 4)
    z[0, 0, 1] = 5.0
    start = torch.tensor([[50.0, -50.0]])
    out = lattice_losses(start, torch.zeros(1, 0, 2, 2), cand, true, z)
    assert float(out["penalty"]) < 1e-6


# ---------------------------------------------------------------- trees

def random_rows(depth, k, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in range(depth):
        lp = torch.log_softmax(torch.randn(k, generator=g) * 2, -1).sort(descending=True).values
        rows.append([(100 * d + j, float(lp[j]), j) for j in range(k)])
    return rows


def conditional_expand(depth, k, seed):
    """Children depend on the parent's rank, like LiLiCorr's rows."""
    g = torch.Generator().manual_seed(seed)
    start = torch.log_softmax(torch.randn(k, generator=g) * 2, -1)
    pair = torch.log_softmax(torch.randn(depth, k, k, generator=g) * 2, -1)

    def row(node):
        lp = start if node.depth == 0 else pair[node.depth - 1, node.payload]
        order = lp.argsort(descending=True).tolist()
        return [(10 * node.depth + j, float(lp[j]), j) for j in order]

    return lambda nodes: [row(n) if n.depth < depth else [] for n in nodes], start, pair


def all_paths(start, pair, depth, k):
    """Every path's cumulative log-prob (brute force)."""
    scores = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = float(start[ranks[0]]) + sum(float(pair[i - 1, ranks[i - 1], ranks[i]]) for i in range(1, d))
            scores.append(s)
    return sorted(scores, reverse=True)


def check_tree(tree, budget):
    assert len(tree) - 1 <= budget
    tree.validate()
    for i, p in enumerate(tree.parents[1:], start=1):
        assert 0 <= p < i                      # parent present, topological order


@pytest.mark.parametrize("shape", ["beam", "best-first", "chain"])
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_tree_respects_closure_and_budget(shape, budget):
    expand, start, pair = conditional_expand(depth=4, k=3, seed=budget)
    tree, nodes = tree_build.build_tree(0, expand, shape=shape, top_k=3, budget=budget, max_depth=4)
    check_tree(tree, budget)
    lp = torch.tensor(tree.logprobs)
    cum = [float(lp[tree.path_to(i)].sum()) for i in range(len(tree))]
    assert all(math.isclose(cum[i], nodes[i].score, abs_tol=1e-5) for i in range(len(tree)))
    if shape == "best-first":   # exactly the `budget` best paths of the whole tree
        best = all_paths(start, pair, 4, 3)[:budget]
        assert sorted(cum[1:], reverse=True) == pytest.approx(best, abs=1e-5)
    if shape == "chain":
        assert tree.is_chain and len(tree) - 1 == min(budget, 4)


@pytest.mark.parametrize("tau", [0.0, 0.5, 2.0, 6.0])
def test_confidence_pruning_keeps_nodes_within_tau(tau):
    rows = random_rows(depth=5, k=4, seed=1)
    tree, nodes = tree_build.build_tree(7, tree_build.static_rows(rows), shape="best-first", top_k=4,
                                        budget=64, max_depth=5, prune_tau=tau)
    check_tree(tree, 64)
    best = rows[0][0][1]
    assert all(n.score >= best - tau - 1e-9 for n in nodes[1:])
    assert len(tree) >= 2                         # the best node always survives
    for rec in tree.pruned:
        if rec["reason"] == "confidence":
            assert rec["cum_logprob"] < best - tau
    # ancestor-closed: every kept node's parent was kept (check_tree), and nothing above the
    # threshold whose parent was kept was dropped for confidence
    loose, _ = tree_build.build_tree(7, tree_build.static_rows(rows), shape="best-first", top_k=4,
                                     budget=64, max_depth=5, prune_tau=None)
    assert len(tree) <= len(loose)


def test_block_drafter_trees_use_slot_marginals(target, prompt):
    drafter = started("block", target, prompt)
    for shape in ("beam", "best-first"):
        draft = drafter.propose(ctx(prompt, tree=shape, top_k=3, budget=10, prune_tau=3.0))
        check_tree(draft.tree, 10)
        # siblings at the same depth carry the same marginal row: same depth -> same candidates
        by_depth: dict[int, set] = {}
        for i in range(1, len(draft.tree)):
            by_depth.setdefault(draft.tree.depths[i], set()).add(draft.tree.tokens[i])
        assert all(len(v) <= 3 for v in by_depth.values())


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("shape", ["chain", "beam", "best-first"])
def test_every_drafter_gives_valid_trees(kind, shape, target, prompt):
    drafter = started(kind, target, prompt)
    for temperature in (0.0, 0.9):
        draft = drafter.propose(ctx(prompt, tree=shape, top_k=3, budget=12, depth=4,
                                    temperature=temperature, prune_tau=4.0))
        check_tree(draft.tree, 12)
        assert draft.tree.tokens[0] == prompt[-1]
        assert len(draft.tree.logprobs) == len(draft.tree)
        if temperature > 0 and shape == "chain":
            assert draft.proposal is not None
            sums = draft.proposal[1:].sum(-1)
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-4)
        else:
            assert draft.proposal is None
        json.dumps(draft.tree.to_dict())


# ---------------------------------------------------------------- state and checkpoints

@pytest.mark.parametrize("kind", DRAFTERS)
def test_state_depends_only_on_accepted_tokens(kind, target, prompt):
    drafter = started(kind, target, prompt)
    before = drafter.context_state()
    draft = drafter.propose(ctx(prompt, tree="best-first", top_k=3, budget=12, depth=4))
    after = drafter.context_state()
    assert all(torch.equal(before[key], after[key]) for key in before)     # propose writes nothing
    # Rejection: only the first drafted token of the best branch is accepted, then a bonus.
    first = draft.tree.children[0][0]
    accepted_tokens = [prompt[-1], draft.tree.tokens[first]]
    bonus = (draft.tree.tokens[first] + 1) % TINY.vocab_size
    full = prompt + accepted_tokens[1:] + [bonus]
    feats, hidden, _ = target_pass(target, full[:-1])
    T = len(prompt) - 1
    drafter.observe(Accepted(accepted_tokens, feats[T:T + 2], hidden[T:T + 2], bonus))
    direct = tiny_drafter(kind, target)
    direct.reset(full, feats, hidden)
    got, want = drafter.context_state(), direct.context_state()
    for key in want:
        assert torch.allclose(got[key], want[key], atol=1e-5), key
    s = ctx(full, tree="best-first", top_k=3, budget=12, depth=4)
    assert drafter.propose(s).tree.tokens == direct.propose(s).tree.tokens


@pytest.mark.parametrize("kind", DRAFTERS)
def test_checkpoint_round_trip(kind, target, prompt, tmp_path):
    drafter = tiny_drafter(kind, target)
    with torch.no_grad():   # the checkpoint is bf16: compare against bf16-rounded weights
        for p in drafter.net.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    feats, hidden, _ = target_pass(target, prompt[:-1])
    drafter.reset(prompt, feats, hidden)
    save_drafter(drafter, tmp_path / kind)
    meta = json.loads((tmp_path / kind / "drafter.json").read_text())
    assert meta["kind"] == kind and meta["target"] == fingerprint_of(target)
    assert (tmp_path / kind / "drafter.safetensors").stat().st_size < 15 * 2**20
    loaded = load_drafter(tmp_path / kind, target)
    loaded.reset(prompt, feats, hidden)
    for shape in ("chain", "best-first"):
        s = ctx(prompt, tree=shape, top_k=3, budget=10, depth=4)
        a, b = drafter.propose(s), loaded.propose(s)
        assert a.tree.tokens == b.tree.tokens and a.tree.parents == b.tree.parents
        assert a.tree.logprobs == pytest.approx(b.tree.logprobs, abs=1e-5)


@pytest.mark.parametrize("settings, match", [
    (dict(top_k=0), "top-k"), (dict(top_k=65), "top-k"), (dict(budget=0), "budget"),
    (dict(block_size=1), "block size"), (dict(block_size=9), "block"),
])
@pytest.mark.parametrize("kind", ["block", "lilicorr"])
def test_bad_settings_raise_clear_errors(kind, settings, match, target, prompt):
    drafter = started(kind, target, prompt)
    with pytest.raises(ValueError, match=match):
        drafter.propose(ctx(prompt, **settings))


def test_bad_settings_eagle_and_lattice_width(target, prompt):
    eagle = started("eagle", target, prompt)
    for bad in (dict(top_k=0), dict(budget=0), dict(depth=0), dict(top_k=100)):
        with pytest.raises(ValueError):
            eagle.propose(ctx(prompt, **bad))
    lili = started("lilicorr", target, prompt)      # trained with top-k 4
    with pytest.raises(ValueError, match="at most 4 candidates"):
        lili.propose(ctx(prompt, top_k=5))


def test_load_rejects_bad_checkpoints(target, prompt, tmp_path):
    drafter = started("lilicorr", target, prompt)
    folder = save_drafter(drafter, tmp_path / "ok")
    other = tiny_target(seed=5)
    with pytest.raises(ValueError, match="another target"):
        load_drafter(folder, other)
    with pytest.raises(ValueError, match="no drafter.json"):
        load_drafter(tmp_path / "missing", target)
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "drafter.json").write_text((folder / "drafter.json").read_text())
    (bad / "drafter.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="corrupt"):
        load_drafter(bad, target)
    (bad / "drafter.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_drafter(bad, target)
    meta = json.loads((folder / "drafter.json").read_text())
    meta["kind"] = "medusa"
    (bad / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown drafter kind"):
        load_drafter(bad, target)
    assert isinstance(DrafterFormatError("x"), ValueError)


# ---------------------------------------------------------------- training

class FlaStyle(nn.Module):
    """fla's model conventions over the runtime's weights, with a plain GDN re-implementation:
    blocks return tuples, `hidden_states` = block inputs + the final-normed output."""

    class Block(nn.Module):
        def __init__(self, block, config):
            super().__init__()
            self.block, self.c = block, config

        def forward(self, x):
            b, c = self.block, self.c
            a = b.attn
            h = b.attn_norm(x)
            T = x.shape[1]

            def conv(proj, conv1d):
                y = F.conv1d(proj(h).transpose(1, 2), conv1d.weight, conv1d.bias,
                             padding=c.conv_size - 1, groups=conv1d.weight.shape[0])
                return F.silu(y[..., :T].transpose(1, 2))

            B = x.shape[0]
            q = F.normalize(conv(a.q_proj, a.q_conv1d).view(B, T, c.num_heads, -1), dim=-1, eps=0) * c.head_dim ** -0.5
            k = F.normalize(conv(a.k_proj, a.k_conv1d).view(B, T, c.num_heads, -1), dim=-1, eps=0)
            v = conv(a.v_proj, a.v_conv1d).view(B, T, c.num_heads, -1)
            g = -a.A_log.exp() * F.softplus(a.a_proj(h) + a.dt_bias)
            beta = a.b_proj(h).sigmoid()
            S = torch.zeros(B, c.num_heads, c.head_dim, c.head_v_dim)
            outs = []
            for t in range(T):
                S = S * g[:, t].exp()[..., None, None]
                delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
                S = S + k[:, t, :, :, None] * delta[:, :, None, :]
                outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
            o = a.o_norm(torch.stack(outs, 1)) * F.silu(a.g_proj(h).view(B, T, c.num_heads, -1))
            x = x + a.o_proj(o.reshape(B, T, -1))
            return (x + b.mlp(b.mlp_norm(x)), None, None, None)

    def __init__(self, runtime):
        super().__init__()
        self.config = runtime.config
        self.model = nn.Module()
        self.model.embeddings = runtime.model.embeddings
        self.model.layers = nn.ModuleList(self.Block(b, runtime.config) for b in runtime.model.layers)
        self.model.norm = runtime.model.norm
        self.lm_head = runtime.lm_head

    def forward(self, input_ids, output_hidden_states=False, use_cache=False, logits_to_keep=0,
                past_key_values=None):
        """With use_cache the "cache" loses the state between calls (as transformers 5.24
        did to fla's generate): a later call sees only its own tokens."""
        x = self.model.embeddings(input_ids)
        hs = []
        for layer in self.model.layers:
            hs.append(x)
            x = layer(x)[0]
        x = self.model.norm(x)
        hs.append(x)
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return SimpleNamespace(logits=logits, hidden_states=tuple(hs),
                               past_key_values=object() if use_cache else None)


def test_fla_style_features_match_the_runtime(target, prompt):
    from specla.train.drafter import FlaTarget, TorchTarget
    tokens = torch.tensor([prompt])
    ours = TorchTarget(target, LAYERS).run(tokens)
    shim = FlaStyle(target)
    theirs = FlaTarget(shim, TINY, LAYERS).run(tokens)
    assert torch.allclose(theirs.features, ours.features, atol=1e-4)
    assert torch.allclose(theirs.last_hidden, ours.last_hidden, atol=1e-4)
    assert torch.allclose(theirs.logits.float(), ours.logits, atol=1e-3)
    hs = shim(tokens, output_hidden_states=True).hidden_states
    # fla's hidden_states[l + 1] is the residual after block l (l < L-1); [-1] is last_hidden
    assert torch.allclose(hs[1], ours.features[:, :, 0], atol=1e-4)
    assert torch.allclose(hs[-1], ours.last_hidden, atol=1e-4)


def test_generation_that_loses_its_state_is_caught(target):
    """The first greedy chunk is checked against one full forward; a cache loop that drops
    the state is replaced by generation without a cache, and the data agree with the target."""
    from specla.train.drafter import FlaTarget, generate_corpus, greedy_agreement
    live = FlaTarget(FlaStyle(target), TINY, LAYERS)
    data = np.random.default_rng(1).integers(0, TINY.vocab_size, 500).astype(np.uint16)
    notes = []
    chunks = generate_corpus(live, data, seconds=0, max_tokens=0, batch=3, prompt_range=(5, 6),
                             new_range=(8, 9), log=notes.append)
    assert live.use_cache is False and any("regenerating without the cache" in n for n in notes)
    assert greedy_agreement(live, chunks) == 1.0
    assert [c.greedy for c in chunks] == [True, False]


def test_training_lowers_the_loss(target):
    from specla.train.drafter import HParams, TorchTarget, Trainer, generate_corpus, sample_batch
    live = TorchTarget(target, LAYERS)
    data = np.random.default_rng(0).integers(0, TINY.vocab_size, 4000).astype(np.uint16)
    chunks = generate_corpus(live, data, seconds=0, max_tokens=0, batch=8, prompt_range=(6, 8),
                             new_range=(20, 24), log=lambda *_: None)
    hp = HParams(width=32, heads=2, mlp_hidden=64, head_width=32, head_heads=2, eagle_mlp_hidden=64,
                 window=8, seqs=8, anchors=8, block_size=6, top_k=4, lr=3e-3, eagle_lr=3e-3,
                 save_every=1e9)
    gen = torch.Generator().manual_seed(0)
    fixed = sample_batch(chunks, 8, gen)
    fixed_out = live.run(fixed[0])
    batches = [(b, p, live.run(b)) for b, p in (sample_batch(chunks, 8, gen) for _ in range(8))]
    from specla.drafters import fingerprint_of
    for kind in DRAFTERS:
        torch.manual_seed(0)
        tr = Trainer(kind, live, hp, fingerprint_of(target), Path("/nonexistent"))
        anchors = tr.block_anchors(fixed[0], fixed[1], 8) if kind != "eagle" else None

        def loss():
            with torch.no_grad():
                return float(tr.losses(fixed[0], fixed[1], fixed_out, anchors, k=4)["loss"])

        first = loss()
        for step in range(40):
            tr.step(*batches[step % len(batches)], 1.0)
        assert loss() < 0.8 * first, kind


def test_training_command_writes_loadable_checkpoints(target, tmp_path):
    from specla.checkpoint import save_model
    from specla.train.drafter import load_runtime_target, main
    save_model(target, TINY, tmp_path / "target")
    (tmp_path / "corpus").mkdir()
    np.random.default_rng(0).integers(0, TINY.vocab_size, 3000).astype(np.uint16).tofile(tmp_path / "corpus" / "train.bin")
    args = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "corpus"),
            "--out", str(tmp_path / "out"), "--state", str(tmp_path / "state"), "--device", "cpu", "--max-steps", "3", "--gen-batch", "2",
            "--gen-tokens", "1", "--width", "32", "--heads", "2", "--mlp-hidden", "64", "--head-width", "32",
            "--head-heads", "2", "--eagle-mlp-hidden", "64", "--window", "8", "--seqs", "2", "--anchors", "4",
            "--feature-layers", "0,1"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary["drafters"]) == set(DRAFTERS)
    first_seconds = {k: v["train_seconds"] for k, v in summary["drafters"].items()}
    # the wall time of the loop that trains every kind together, not each kind's own host time
    assert len(set(first_seconds.values())) == 1 and min(first_seconds.values()) > 0
    assert summary["data"]["greedy_agreement"] == 1.0
    sent_back = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert sent_back == sorted(["summary.json"] + [f"{k}/drafter.{e}" for k in DRAFTERS for e in ("json", "safetensors")])
    runtime = load_runtime_target(tmp_path / "target")
    for kind in DRAFTERS:
        drafter = load_drafter(tmp_path / "out" / kind, runtime)
        assert drafter.kind == kind
    assert main(args + ["--resume"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert all(v["resumed"] and v["steps"] == 6 for v in summary["drafters"].values())
    assert all(v["train_seconds"] > first_seconds[k] for k, v in summary["drafters"].items())


def test_a_lilicorr_trainer_seeds_its_block_part_from_a_block_drafter(target, tmp_path):
    """--init-from: every tensor the block drafter shares by name and shape is copied (bf16 as
    saved); the LiLiCorr head keeps its fresh init; a drafter for another target is refused."""
    from specla.drafters import wrap
    block, _ = trainer_for("block", target)
    save_drafter(wrap("block", block.net, target, 4), tmp_path / "block")
    lilicorr, _ = trainer_for("lilicorr", target)
    head_before = {n: p.clone() for n, p in lilicorr.net.named_parameters() if n.startswith("head.")}
    seeded = lilicorr.seed_from(tmp_path / "block")
    mine = dict(lilicorr.net.named_parameters())
    assert sorted(seeded) == sorted(n for n, _ in block.net.named_parameters())
    for n, p in block.net.named_parameters():
        assert torch.equal(mine[n], p.detach().to(torch.bfloat16).float()), n
    assert head_before and all(torch.equal(mine[n], p) for n, p in head_before.items())
    other, _ = trainer_for("lilicorr", tiny_target(seed=5))
    with pytest.raises(ValueError, match="another target"):
        other.seed_from(tmp_path / "block")
    with pytest.raises(ValueError, match="no drafter.json"):
        lilicorr.seed_from(tmp_path)


# ---------------------------------------------------------------- training == inference

def trainer_for(kind, target, tmp_path=Path("/nonexistent")):
    from specla.train.drafter import HParams, TorchTarget, Trainer
    hp = HParams(width=32, heads=2, mlp_hidden=64, head_width=32, head_heads=2, eagle_mlp_hidden=64,
                 window=8, block_size=6, top_k=4)
    torch.manual_seed(2)
    live = TorchTarget(target, LAYERS)
    return Trainer(kind, live, hp, fingerprint_of(target), tmp_path), live


@pytest.mark.parametrize("kind", ["block", "lilicorr"])
def test_block_training_pass_equals_the_drafter_at_inference(kind, target, prompt):
    """The block the trainer scores at anchor a is the block the drafter drafts after reset
    with the prompt x_0..x_a (context a-W..a-1, root x_a, same anchor row)."""
    from specla.drafters import wrap
    from specla.drafters.lilicorr import lattice
    tr, live = trainer_for(kind, target)
    seq = torch.tensor([prompt + prompt[:6]])
    tout = live.run(seq)
    for a in (3, 12):   # a short context (padded window) and a full one
        with torch.no_grad():
            h, logits, ctx_rows, true, _ = tr.block_forward(seq, tout, torch.tensor([[a]]))
        drafter = wrap(kind, tr.net, target, 4)
        drafter.reset(seq[0, :a + 1].tolist(), tout.features[0, :a], tout.last_hidden[0, :a])
        h2, logits2 = drafter._slots(int(seq[0, a]))
        assert torch.allclose(logits[0], logits2, atol=1e-4)
        assert torch.equal(true[0], seq[0, a + 1:a + 6])
        if kind == "lilicorr":
            with torch.no_grad():
                train_lat = lattice(tr.parts, tr.net.head, logits, h, ctx_rows[:, -1], 3)
                inf_lat = lattice(tr.parts, tr.net.head, logits2[None], h2[None], drafter.ctx[-1:], 3)
            assert torch.equal(train_lat[0], inf_lat[0])
            assert torch.allclose(train_lat[3], inf_lat[3], atol=1e-4)


def test_eagle_unrolled_training_equals_tree_drafting(target, prompt):
    """Step u of the unrolled training forward is a depth-(u-1) node at inference: same
    context window, same drafted hiddens, same distribution."""
    from specla.drafters import wrap
    from specla.drafters.eagle import _TreeSearch
    tr, live = trainer_for("eagle", target)
    seq = torch.tensor([prompt + prompt[:4]])
    tout = live.run(seq)
    T = 11
    with torch.no_grad():
        outs = tr.net.unrolled(tr.parts, seq, tout.last_hidden, steps=3)
    drafter = wrap("eagle", tr.net, target, 4)
    drafter.reset(seq[0, :T + 1].tolist(), None, tout.last_hidden[0, :T])
    search = _TreeSearch(drafter, ctx(seq[0, :T + 1].tolist(), tree="beam", top_k=TINY.vocab_size))
    node = tree_build.Node(0, int(seq[0, T]), -1, 0.0, 0.0, 0, None)
    for u in range(1, 4):
        row = search.expand([node])[0]
        got = torch.full((TINY.vocab_size,), float("nan"))
        for token, lp, _ in row:
            got[token] = lp
        want = torch.log_softmax(tr.parts.logits(outs[u - 1][0, T + u - 2]).float(), -1)
        assert torch.allclose(got, want, atol=1e-4), u
        token = int(seq[0, T + u])          # continue along the data: the next depth's node
        slot = row[0][2][0]
        node = tree_build.Node(u, token, node.index, 0.0, 0.0, u, (slot, None))


def test_segmented_target_run_equals_one_pass(target, prompt):
    from specla.train.drafter import TorchTarget
    live = TorchTarget(target, LAYERS)
    seq = torch.tensor([prompt, prompt[::-1]])
    a, b = live.run(seq, segment=5), live.run(seq, segment=128)
    assert torch.allclose(a.features, b.features, atol=1e-5)
    assert torch.allclose(a.logits, b.logits, atol=1e-4)


def test_block_pass_packs_its_projections_at_inference_only(target, prompt):
    """At inference q|k|v, k|v and gate|up are each one matmul over weights concatenated once
    (`block.project`): the same logits as the separate layers under autograd, which still
    get their gradients; an in-place weight update (an optimizer step) is followed."""
    torch.manual_seed(0)
    drafter = new_drafter("block", target, feature_layers=(0, 1), block_size=4, width=32, heads=2,
                          mlp_hidden=64, window=8)
    net, parts = drafter.net, drafter.parts
    ctx = torch.randn(1, 5, 32)
    root = torch.tensor([prompt[0]])

    def slot_logits():
        return net(parts, root, ctx)[1]

    with torch.no_grad():
        packed = slot_logits()
    layer = net.layers[0]
    assert {"_cache_qkv", "_cache_kv"} <= set(layer.attn.__dict__) and "_cache_gate_up" in layer.mlp.__dict__
    plain = slot_logits()                          # autograd on: the separate layers
    assert torch.allclose(packed, plain, atol=1e-5)
    plain.sum().backward()
    for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        layer.attn.k_proj.weight.mul_(1.5)         # in place: same storage, new version
        layer.mlp.up_proj.weight.add_(0.05)
        updated = slot_logits()
    assert torch.allclose(updated, slot_logits(), atol=1e-5) and not torch.allclose(updated, packed, atol=1e-3)
