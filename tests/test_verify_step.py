"""The persistent one-launch chain verification (kernels/triton_verify_step.py) against
`chain_verify_step_ref`: logits, the normed rows, features, the state with the pending
commit folded, and every factor, over two calls in a row. On the GPU with a full grid and
with a few programs; on the CPU through Triton's interpreter with one program."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from kernels import reference
from tests.test_decode_step import SHAPES, random_weights, run_interpreted
from tests.test_kernels import RTOL, needs_cuda, rel_err


def check_chain_verify(L: int, D: int, H: int, K: int, V: int, W: int, I: int, vocab: int, dtype, device,
                       nodes: int, pending: bool = True, features: tuple[int, ...] = (), bias: bool = False,
                       neg_eigval: bool = False, programs: int | None = None, seed: int = 0,
                       blocks: dict[str, int] | None = None, parents: list[int] | None = None) -> list[str]:
    """Two chains (or trees of `parents`) verified from one random state; the second call
    folds a different pending commit into the state the first left, so a stale read, a
    missed barrier or a counter left armed shows in the second."""
    from kernels.triton_verify_step import PersistentChainVerify
    wt = random_weights(L, D, H, K, V, W, I, vocab, dtype, device, bias, seed)
    wt_cpu = reference.DecodeWeights(**{k: None if v is None else v.cpu() for k, v in vars(wt).items()})
    gen = torch.Generator().manual_seed(seed + 1)
    C, P, n = H * (2 * K + V), 5, nodes
    cache = torch.randn(L, 1, C, W, generator=gen).to(device=device, dtype=dtype)
    S = (torch.randn(L, 1, H, K, V, generator=gen) * 0.1).to(device)
    verify = PersistentChainVerify(wt, H, K, V, 1e-6, n, features, neg_eigval=neg_eigval, programs=programs,
                                   blocks=blocks)
    f32 = dict(device=device, dtype=torch.float32)
    factors = (torch.zeros(L, 1, n, H, K, **f32), torch.zeros(L, 1, n, H, **f32), torch.zeros(L, 1, n, H, V, **f32),
               torch.zeros(L, 1, n, C, device=device, dtype=dtype))
    logits, hidden = torch.zeros(n, vocab, **f32), torch.zeros(n, D, device=device, dtype=dtype)
    feats = torch.zeros(n, len(features), D, device=device, dtype=dtype) if features else None
    root = torch.zeros(1, dtype=torch.long, device=device)
    tree = None if parents is None else (torch.tensor(parents, device=device),
                                         reference.tree_conv_index(parents, W).to(device))
    # fp32: the order of sums only; bf16: every projection rounds its output, over the layers
    tol = RTOL if dtype == torch.float32 else 4e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 2e-2
    problems = []
    for call in range(2):
        chain = torch.randint(2, vocab, (n,), generator=gen).tolist()
        tokens = torch.tensor([[-1] + chain[1:]], device=device)       # the kernel writes the root in
        root.fill_(chain[0])
        kp = torch.randn(L, 1, P, H, K, generator=gen)
        kp = kp / kp.norm(dim=-1, keepdim=True)
        pend = (kp, torch.randn(L, 1, P, H, V, generator=gen) * 0.1, -torch.rand(L, 1, P, H, generator=gen) * 0.5)
        S_before = S.cpu().clone()
        want = reference.chain_verify_step_ref(chain, wt_cpu, cache.cpu(), S_before, 1e-6, K, V,
                                               pend if pending else None, features, neg_eigval=neg_eigval,
                                               parents=parents)
        verify(tokens, root, cache, S, tuple(t.to(device) for t in pend) if pending else None, logits, hidden,
               feats, factors, tree=tree)
        got = dict(logits=logits, hidden=hidden, features=feats, S=S, k=factors[0], g=factors[1],
                   delta=factors[2], conv_in=factors[3])
        for name, value in got.items():
            if value is None:
                continue
            err = rel_err(value.float(), want[name].float())
            if not err < tol:
                problems.append(f"call {call}: {name} relative error {err:.2e}")
        if tokens[0, 0].item() != chain[0]:
            problems.append(f"call {call}: tokens[0] = {tokens[0, 0].item()}, not the root {chain[0]}")
    if verify.failed():
        problems.append("a barrier gave up waiting")
    return problems


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("programs", [None, 7])
def test_chain_verify_matches_reference(shape, dtype, programs):
    L = SHAPES[shape][0]
    assert not check_chain_verify(*SHAPES[shape], dtype, "cuda", nodes=8, features=(0, L - 1),
                                  bias=shape == "tiny", neg_eigval=shape == "wide-heads", programs=programs)


@needs_cuda
@pytest.mark.parametrize("nodes", [1, 3, 16])
def test_chain_verify_node_counts(nodes):
    assert not check_chain_verify(*SHAPES["embedded"], torch.float32, "cuda", nodes=nodes, pending=nodes != 3,
                                  features=(1,))


SPLIT_HEADS = (2, 64, 2, 32, 32, 4, 64, 96)     # L, D, H, K, V, W, I, vocab: heads wider than a unit


@needs_cuda
@pytest.mark.parametrize("bn_in", [16, 32, 64])
def test_chain_verify_in_proj_widths(bn_in):
    """Units of the input projection a quarter, half and a whole head wide (the l2 norms of q
    and k taken in phase B either way)."""
    assert not check_chain_verify(*SHAPES["embedded"], torch.bfloat16, "cuda", nodes=9, features=(1,),
                                  blocks={"BN_IN": bn_in})


# a static tree of 16 nodes (two branches at the root, one deeper) and a best-first-like one
TREES = {"static-16": [-1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 8, 3, 1, 11, 9],
         "bushy-7": [-1, 0, 0, 0, 1, 1, 2]}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tree", list(TREES))
def test_tree_verify_matches_reference(tree, dtype):
    parents = TREES[tree]
    assert not check_chain_verify(*SHAPES["embedded"], dtype, "cuda", nodes=len(parents), features=(1, 5),
                                  parents=parents)


def test_chain_verify_rejects_bad_input():
    pytest.importorskip("triton")
    from kernels.triton_verify_step import PersistentChainVerify
    wt = random_weights(2, 32, 2, 16, 16, 4, 32, 40, torch.float32, "cpu", False, 0)
    with pytest.raises(ValueError, match="nodes"):
        PersistentChainVerify(wt, 2, 16, 16, 1e-6, 17)
    with pytest.raises(ValueError, match="feature layers"):
        PersistentChainVerify(wt, 2, 16, 16, 1e-6, 4, feature_layers=(1, 0))
    with pytest.raises(ValueError, match="do not fit"):
        PersistentChainVerify(wt, 3, 16, 16, 1e-6, 4)
    with pytest.raises(ValueError, match="no tiles named"):
        PersistentChainVerify(wt, 2, 16, 16, 1e-6, 4, blocks={"BN_UP": 16})
    with pytest.raises(ValueError, match="BN_IN 8"):
        PersistentChainVerify(wt, 2, 16, 16, 1e-6, 4, blocks={"BN_IN": 8})
    with pytest.raises(ValueError, match="whole heads"):
        PersistentChainVerify(wt, 2, 16, 16, 1e-6, 4, blocks={"BK_O": 24})
    verify = PersistentChainVerify(wt, 2, 16, 16, 1e-6, 4)
    with pytest.raises(ValueError, match="tokens"):
        verify(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, dtype=torch.long), None, None, None,
               None, None, None, (torch.zeros(2, 1, 4, 2, 16),) * 4)
    f32 = dict(dtype=torch.float32)
    factors = (torch.zeros(2, 1, 4, 2, 16, **f32), torch.zeros(2, 1, 4, 2, **f32), torch.zeros(2, 1, 4, 2, 16, **f32),
               torch.zeros(2, 1, 4, 2 * 48))
    with pytest.raises(ValueError, match="a tree's parents"):
        verify(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(2, 1, 96, 4),
               torch.zeros(2, 1, 2, 16, 16), None, torch.zeros(4, 40), torch.zeros(4, 32), None, factors,
               tree=(torch.tensor([-1, 0, 0]), torch.zeros(4, 4, dtype=torch.long)))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("programs", [None, 7])
def test_chain_verify_fold_in_b_matches_reference(dtype, programs, monkeypatch):
    """The deferred commit folded at the head of phase B's units (FOLD_IN_A off), the
    default's alternative."""
    from kernels import triton_verify_step
    monkeypatch.setattr(triton_verify_step, "FOLD_IN_A", False)
    L = SHAPES["embedded"][0]
    assert not check_chain_verify(*SHAPES["embedded"], dtype, "cuda", nodes=8, features=(0, L - 1),
                                  programs=programs)


def test_chain_verify_interpreter():
    """One program through Triton's CPU interpreter: every phase's arithmetic against the
    reference and the barriers' bookkeeping over two calls."""
    assert run_interpreted(__file__).count("ok ") == 7


def check_packed_target(dtype, deferred: bool) -> list[str]:
    """The runtime's side: the verifier over a random model's stacked weights against the
    packed target's own tree forward (`check_chain_verify`, which the engine runs before it
    uses the kernel)."""
    from kernels.triton_verify_step import PersistentChainVerify
    from specla.graphs.runtime import PackedTarget
    from specla.graphs.whole_step import check_chain_verify, stack_weights
    from tests.helpers import random_target
    target = random_target(vocab=64, hidden=64, std=0.2).to(dtype)
    packed = PackedTarget(target, ops="torch")
    c = packed.config
    verifier = PersistentChainVerify(stack_weights(packed), c.num_heads, c.head_dim, c.head_v_dim, c.norm_eps, 6,
                                     feature_layers=(0,), programs=1)
    problem = check_chain_verify(packed, verifier, deferred)
    return [problem] if problem else []


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    failed = 0
    for dtype in (torch.float32, torch.bfloat16):
        # bf16 with the output and down projections split over K (2 and 4 slices)
        split = {"BK_O": 16, "BK_I": 16} if dtype == torch.bfloat16 else None
        problems = check_chain_verify(*SHAPES["tiny"], dtype, "cpu", nodes=5, features=(0, 1), blocks=split,
                                      bias=dtype == torch.float32, neg_eigval=dtype == torch.bfloat16, programs=1)
        print(("FAIL " if problems else "ok ") + str(dtype) + " " + "; ".join(problems))
        failed += bool(problems)
    problems = check_chain_verify(*SHAPES["tiny"], torch.float32, "cpu", nodes=7, features=(1,), programs=1,
                                  parents=TREES["bushy-7"])
    print(("FAIL " if problems else "ok ") + "tree " + "; ".join(problems))
    failed += bool(problems)
    # heads of 32: the input projection's 16-column units each hold half a head's q, k or v
    problems = check_chain_verify(*SPLIT_HEADS, torch.float32, "cpu", nodes=6, features=(0,), programs=1)
    print(("FAIL " if problems else "ok ") + "split heads " + "; ".join(problems))
    failed += bool(problems)
    from kernels import triton_verify_step
    triton_verify_step.FOLD_IN_A = False
    problems = check_chain_verify(*SHAPES["tiny"], torch.float32, "cpu", nodes=5, features=(0,), programs=1)
    triton_verify_step.FOLD_IN_A = True
    print(("FAIL " if problems else "ok ") + "fold in phase B " + "; ".join(problems))
    failed += bool(problems)
    for deferred in (True, False):
        problems = check_packed_target(torch.float32, deferred)
        print(("FAIL " if problems else "ok ") + f"packed target, deferred={deferred} " + "; ".join(problems))
        failed += bool(problems)
    sys.exit(1 if failed else 0)
