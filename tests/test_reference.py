"""The plain-torch recurrences against fla's naive reference, on chains and trees."""
import random

import pytest
import torch
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

from kernels.reference import (chain_verify_ref, commit_ref, heavy_light_chains, hybrid_verify_ref,
                               tree_verify_ref)
from tests.helpers import random_inputs


def naive_path(q, k, v, g, beta, S0, path):
    o, S = naive_recurrent_gated_delta_rule(q[:, path], k[:, path], v[:, path], beta[:, path],
                                            g[:, path], scale=1.0, initial_state=S0,
                                            output_final_state=True)
    return o, S


@pytest.mark.parametrize("N,H,K,V", [(1, 1, 4, 4), (7, 2, 8, 16), (33, 3, 16, 8)],
                         ids=lambda x: str(x))
def test_chain_forms_match_fla_naive(N, H, K, V):
    q, k, v, g, beta, S0 = random_inputs(2, N, H, K, V, seed=N)
    o_ref, S_ref = naive_path(q, k, v, g, beta, S0, list(range(N)))
    chain = torch.arange(N) - 1
    for o, delta in (chain_verify_ref(q, k, v, g, beta, S0),
                     tree_verify_ref(q, k, v, g, beta, S0, chain),
                     hybrid_verify_ref(q, k, v, g, beta, S0, chain)):
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(commit_ref(S0, k, delta, g), S_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_tree_forms_see_only_their_ancestors(seed):
    rng = random.Random(seed)
    N = rng.randint(2, 24)
    parents = [-1] + [rng.randrange(i) for i in range(1, N)]
    q, k, v, g, beta, S0 = random_inputs(1, N, 2, 8, 8, seed=seed)
    P = torch.tensor(parents)
    o_tree, d_tree = tree_verify_ref(q, k, v, g, beta, S0, P)
    o_hyb, d_hyb = hybrid_verify_ref(q, k, v, g, beta, S0, P)
    torch.testing.assert_close(o_tree, o_hyb, rtol=1e-5, atol=1e-5)
    for node in range(N):
        path, x = [], node
        while x >= 0:
            path.append(x)
            x = parents[x]
        path.reverse()
        o_path, S_path = naive_path(q, k, v, g, beta, S0, path)
        torch.testing.assert_close(o_tree[:, node], o_path[:, -1], rtol=1e-5, atol=1e-5)
        # The state at the end of any path, rebuilt from that path's factors.
        torch.testing.assert_close(commit_ref(S0, k[:, path], d_tree[:, path], g[:, path]), S_path,
                                   rtol=1e-5, atol=1e-5)


def test_hand_worked_three_node_tree():
    """K = V = 1, S0 = 0: root r, two children a and b.

    With unit keys, beta = 1/2, g = 0 (no decay), v = (2, 4, 6):
      delta_r = 1/2 (2 - 0) = 1,           S_r = 1
      delta_a = 1/2 (4 - S_r) = 1.5,       S_a = 2.5
      delta_b = 1/2 (6 - S_r) = 2.5,       S_b = 3.5   (b never sees a)
    and o = S q with q = 1.
    """
    one = torch.ones(1, 3, 1, 1)
    v = torch.tensor([2.0, 4.0, 6.0]).view(1, 3, 1, 1)
    g = torch.zeros(1, 3, 1)
    beta = torch.full((1, 3, 1), 0.5)
    S0 = torch.zeros(1, 1, 1, 1)
    o, delta = tree_verify_ref(one, one, v, g, beta, S0, torch.tensor([-1, 0, 0]))
    assert o.flatten().tolist() == [1.0, 2.5, 3.5]
    assert delta.flatten().tolist() == [1.0, 1.5, 2.5]
    committed = commit_ref(S0, one[:, [0, 2]], delta[:, [0, 2]], g[:, [0, 2]])
    assert committed.item() == 3.5


def test_heavy_light_chains_cover_the_tree_once():
    parents = [-1, 0, 1, 1, 0, 0, 5, 2, 4]
    chains = heavy_light_chains(parents)
    assert sorted(n for c in chains for n in c) == list(range(len(parents)))
    for chain in chains:
        assert all(parents[b] == a for a, b in zip(chain, chain[1:]))
    assert chains[0] == [0, 1, 2, 7]    # the root's chain follows the largest subtrees
