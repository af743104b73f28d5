"""Greedy acceptance inside the persistent chain verification (kernels/triton_chain_accept.py)
against the speculative step's torch acceptance (`GraphedSpec.accept`) on the same logits:
two specs share one verifier and one draft each step, one accepts in the launch and one with
torch ops, and every buffer they leave must agree (the state, the pending commit, the conv
window, the counters, the output, the step log, the result). On the GPU through the engine's
own verifier; on the CPU through Triton's interpreter with one program."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.test_decode_step import run_interpreted
from tests.test_kernels import needs_cuda


def greedy_tokens(packed, state, root: int, n: int) -> list[int]:
    """n greedy tokens after root from a copy of `state` (the op set's AR forward)."""
    state, out, token = state.clone(), [], root
    for _ in range(n):
        logits = packed.ar_forward(torch.tensor([[token]], device=packed.device), state)
        token = int(logits.view(-1).argmax())
        out.append(token)
    return out


def tree_draft(tokens: torch.Tensor, parents: list[int], pos: int, cont: list[int], vocab: int,
               gen: torch.Generator, alpha: float = 0.7) -> None:
    """Draft a tree into tokens[0, 1:]: a node on the true path whose earlier siblings all
    missed drafts the true next token with probability alpha, any other node a wrong one,
    so the walk leaves the first child as often as it takes it."""
    depth, good, taken = [0] * len(parents), {0}, set()
    for i in range(1, len(parents)):
        p = parents[i]
        depth[i] = depth[p] + 1
        true = cont[pos + depth[i] - 1]
        if p in good and p not in taken and torch.rand((), generator=gen) < alpha:
            good.add(i)
            taken.add(p)
            tokens[0, i] = true
        else:
            tokens[0, i] = (true + 1 + int(torch.randint(vocab - 1, (), generator=gen))) % vocab


def check_chain_accept(device: str, use_oracle: bool, nodes: int = 6, steps: int = 6,
                       verifier=None, parents: list[int] | None = None) -> list[str]:
    """`steps` steps of a chain of `nodes` drafted by an oracle at alpha 0.85 from the AR
    continuation (or of a tree of `parents`, drafted by `tree_draft`); the fused and the
    torch acceptance compared after each. `verifier` replaces the engine's persistent
    verifier (the interpreter's one-program kernel)."""
    from specla.graphs.oracle import DeviceOracle
    from specla.graphs.runtime import PackedTarget, StaticState
    from specla.graphs.spec import GraphedSpec, SpecState
    from specla.tree import DraftTree
    from tests.helpers import random_target

    tree = DraftTree.chain([0] * nodes) if parents is None else DraftTree([0] * len(parents), parents)
    nodes = len(tree)
    target = random_target(vocab=96, hidden=64, std=0.25).to(device)
    packed = PackedTarget(target, ops="auto")
    if verifier is not None:
        packed.chain_verifier = lambda n, layers, deferred: (verifier(packed, n, layers), "interpreted")
    gen = torch.Generator().manual_seed(1)
    start = StaticState(packed.config, packed.device, packed.dtype)
    start.recurrent.copy_(torch.randn(start.recurrent.shape, generator=gen) * 0.1)
    start.conv.copy_(torch.randn(start.conv.shape, generator=gen))
    root, capacity = 5, steps * nodes + 4 * nodes
    cont = greedy_tokens(packed, start, root, capacity)
    oracle = DeviceOracle(cont, packed.config.vocab_size, 0.85, max_steps=steps + 1, max_nodes=nodes,
                          capacity=capacity + 4 * nodes, device=packed.device, seed=3)
    specs = []
    for fused in (True, False):
        state = SpecState(packed, max_path=nodes + 2, capacity=capacity, max_nodes=nodes + 1)
        state.reset(start, root)
        specs.append(GraphedSpec(packed, state, tree, mode="auto", feature_layers=(0,), use_graph=False,
                                 oracle=oracle if use_oracle else None, fused_accept=fused))
    fused, plain = specs
    if not fused.kernel_accept or plain.kernel_accept or fused.chain_verify is None:
        return [f"the fused spec does not accept in the launch: {fused.verify_note}"]
    problems, accepted, branched = [], [], False
    for s in range(steps):
        if parents is not None:
            tree_draft(plain.tokens, parents, int(plain.state.pos), cont, packed.config.vocab_size, gen)
            fused.tokens.copy_(plain.tokens)
        for spec in specs:
            if parents is None:
                oracle.draft(spec.tokens, spec.topo, spec.state.pos, spec.state.step)
            spec.verify()
            spec.accept()
        accepted.append(int(plain.state.last[0]))
        if parents is not None:
            path = plain.result[3:3 + accepted[-1] + 1].tolist()
            branched |= any(parents.index(parents[node]) != node for node in path[1:])
        pairs = [("tokens", fused.tokens, plain.tokens), ("result", fused.result, plain.result),
                 ("logits", fused.logits, plain.logits)]
        names = ["recurrent", "conv", "pk", "pd", "pg", "root", "pos", "step", "out", "acc", "div", "gap", "last",
                 "log.tokens", "log.parents", "log.choice", "log.target_prob", "log.draft_logp", "log.result"]
        pairs += list(zip(names, fused.state.buffers(), plain.state.buffers()))
        for name, got, want in pairs:
            same = (torch.allclose(got, want, rtol=1e-5, atol=1e-6) if name in ("log.target_prob", "gap")
                    else torch.equal(got, want))
            if not same:
                problems.append(f"step {s}: {name} differs")
    if len(set(accepted)) < 2 or max(accepted) == 0:
        problems.append(f"the drafts exercised too little: accepted {accepted}")
    if parents is not None and not branched:
        problems.append("no accepted path left the first children")
    return problems


TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6]      # branches at depths 1 to 3


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_oracle", [False, True], ids=["drafter", "oracle"])
def test_fused_accept_matches_torch_accept(use_oracle):
    assert not check_chain_accept("cuda", use_oracle)


@needs_cuda
@pytest.mark.gpu
def test_fused_tree_accept_matches_torch_accept():
    assert not check_chain_accept("cuda", False, steps=8, parents=TREE)


def test_fused_accept_needs_a_deferred_commit():
    pytest.importorskip("triton")
    from kernels.triton_chain_accept import ChainAccept
    from kernels.triton_verify_step import PersistentChainVerify
    from tests.test_decode_step import random_weights
    wt = random_weights(2, 32, 2, 16, 16, 4, 32, 40, torch.float32, "cpu", False, 0)
    verify = PersistentChainVerify(wt, 2, 16, 16, 1e-6, 4)
    accept = ChainAccept(**{name: torch.zeros(2, 3, dtype=torch.long) for name in (
        "choice", "prob", "pos", "step", "out", "acc", "last", "result", "log_tokens", "log_parents",
        "log_choice", "log_prob", "log_result")})
    f32 = dict(dtype=torch.float32)
    factors = (torch.zeros(2, 1, 4, 2, 16, **f32), torch.zeros(2, 1, 4, 2, **f32), torch.zeros(2, 1, 4, 2, 16, **f32),
               torch.zeros(2, 1, 4, 2 * 48))
    args = (torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(2, 1, 96, 4),
            torch.zeros(2, 1, 2, 16, 16), None, torch.zeros(4, 40), torch.zeros(4, 32), None, factors)
    with pytest.raises(ValueError, match="pending"):
        verify(*args, accept=accept)
    pending = (torch.zeros(2, 1, 5, 2, 16), torch.zeros(2, 1, 5, 2, 16), torch.zeros(2, 1, 5, 2))
    with pytest.raises(ValueError, match="buffers for 4 nodes"):
        verify(*args[:4], pending, *args[5:], accept=accept)


def interpreted_verifier(packed, nodes: int, layers: tuple[int, ...]):
    from kernels.triton_verify_step import PersistentChainVerify
    from specla.graphs.whole_step import stack_weights
    c = packed.config
    return PersistentChainVerify(stack_weights(packed), c.num_heads, c.head_dim, c.head_v_dim, c.norm_eps, nodes,
                                 tuple(layers), programs=1)


def test_fused_accept_interpreter():
    """One program through Triton's CPU interpreter, with and without the oracle's check."""
    assert run_interpreted(__file__).count("ok ") == 3


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    failed = 0
    for use_oracle in (False, True):
        problems = check_chain_accept("cpu", use_oracle, steps=4, verifier=interpreted_verifier)
        print(("FAIL " if problems else "ok ") + f"oracle={use_oracle} " + "; ".join(problems))
        failed += bool(problems)
    problems = check_chain_accept("cpu", False, steps=6, verifier=interpreted_verifier, parents=TREE)
    print(("FAIL " if problems else "ok ") + "tree " + "; ".join(problems))
    failed += bool(problems)
    sys.exit(1 if failed else 0)
