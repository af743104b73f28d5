"""The AR token of a narrow target as one persistent launch (`kernels/triton_decode_step.py`),
and a draft chain's verification forward as another (`kernels/triton_verify_step.py`).

The fused op set's AR step is 38 launches on the embedded model, and a chain's verification
45, each a few microseconds of launch and ramp around almost no work; the persistent kernels
run the same arithmetic with grid-wide barriers between the phases instead. `whole_step_for`
and `chain_verify_for` build them for a packed target where they apply and check them
against the op set's own forwards first, so a kernel that disagrees is never used (the note
says why).
"""
from __future__ import annotations

import torch

from kernels.reference import DecodeWeights
from specla.config import GDNConfig

# The whole step is for targets whose step is launch-bound: up to this hidden width, where
# each phase's weights are a few MB and its barrier costs about what a launch does. Wider
# targets stream their weights, which the per-op kernels' grids do better.
WHOLE_STEP_MAX_HIDDEN = 1024
# The grid of the whole step (None: one program an SM); benchmarks sweep it.
WHOLE_STEP_PROGRAMS: int | None = None
# Verify draft chains in one persistent launch wherever the whole AR step applies.
WHOLE_VERIFY = True
# ...and accept greedy chains in that launch too (kernels/triton_chain_accept.py).
FUSED_ACCEPT = True


def whole_step_applies(config: GDNConfig, device: torch.device, ops_name: str) -> str | None:
    """None if the whole step applies, else why not."""
    V = config.head_v_dim
    if device.type != "cuda" or ops_name != "fused":
        return "the fused op set on CUDA only"
    if config.hidden_size > WHOLE_STEP_MAX_HIDDEN:
        return f"hidden {config.hidden_size} > {WHOLE_STEP_MAX_HIDDEN}: the per-op kernels stream wide weights better"
    if not config.use_gate or V < 16 or V & (V - 1):
        return "an output gate and power-of-two head widths from 16 only"
    return None


def stack_weights(packed) -> DecodeWeights:
    """The packed layers' weights stacked [L, ...]; each layer's fields become views of the
    stacks, so the weights are held once."""
    layers = packed.layers
    names = ("attn_norm", "w_in", "conv_w", "neg_A", "dt_bias", "o_norm", "w_o", "mlp_norm", "w_gate_up", "w_down")
    stacks = {name: torch.stack([getattr(layer, name) for layer in layers]).contiguous() for name in names}
    has_bias = layers[0].conv_b is not None
    stacks["conv_b"] = torch.stack([layer.conv_b for layer in layers]).contiguous() if has_bias else None
    for l, layer in enumerate(layers):
        for name, stack in stacks.items():
            if stack is not None:
                setattr(layer, name, stack[l])
    return DecodeWeights(embed=packed.embed.contiguous(), final_norm=packed.norm_w.contiguous(),
                         lm_head=packed.lm_head.contiguous(), **stacks)


def whole_step_for(packed):
    """(PersistentDecodeStep, note) for a PackedTarget, or (None, why not)."""
    c, programs = packed.config, WHOLE_STEP_PROGRAMS
    why = whole_step_applies(c, packed.device, packed.ops.name)
    if why is not None:
        return None, why
    try:
        from kernels.triton_decode_step import PersistentDecodeStep
        step = PersistentDecodeStep(stack_weights(packed), c.num_heads, c.head_dim, c.head_v_dim, c.norm_eps,
                                    swish=c.output_gate_activation in ("swish", "silu"),
                                    neg_eigval=c.allow_neg_eigval, programs=programs)
        problem = check_whole_step(packed, step)
    except Exception as err:  # noqa: BLE001 - any failure: the per-op AR step
        problem = f"{type(err).__name__}: {err}"
    if problem:
        return None, f"whole-step kernel unusable: {problem}"
    return step, f"the AR token as one persistent launch ({step.programs} programs)"


@torch.no_grad()
def check_whole_step(packed, step, tokens: int = 3, seed: int = 0) -> str | None:
    """Run `tokens` tokens from a random state through the whole step and through the op
    set's AR forward; None if logits, state and conv cache agree, else what differs."""
    from specla.graphs.runtime import StaticState
    gen = torch.Generator(device="cpu").manual_seed(seed)
    c = packed.config
    mine = StaticState(c, packed.device, packed.dtype)
    mine.recurrent.copy_(torch.randn(mine.recurrent.shape, generator=gen) * 0.1)
    mine.conv.copy_(torch.randn(mine.conv.shape, generator=gen))
    theirs = mine.clone()
    logits = torch.empty(c.vocab_size, device=packed.device)
    tol = 1e-3 if packed.dtype == torch.float32 else 5e-2
    for t in range(tokens):
        token = torch.randint(c.vocab_size, (1, 1), generator=gen).to(packed.device)
        step(token, mine.conv, mine.recurrent, logits)
        want = packed.ar_forward(token, theirs).view(-1)
        problem = first_difference([("logits", logits, want), ("state", mine.recurrent, theirs.recurrent),
                                    ("conv cache", mine.conv, theirs.conv)], tol)
        if problem:
            return f"token {t}: {problem}"
    return "a grid barrier gave up waiting" if step.failed() else None


def first_difference(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], tol: float) -> str | None:
    """The first (name, got, want) whose relative error is not below tol, said; else None."""
    for name, got, ref in pairs:
        err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()
        if not err < tol:
            return f"{name} relative error {err:.2e}"
    return None


def chain_verify_for(packed, nodes: int, feature_layers: tuple[int, ...], deferred: bool):
    """(PersistentChainVerify, note) for a chain of `nodes` of a PackedTarget whose AR token
    is one persistent launch (the verifier reads the same stacked weights), or (None, why not)."""
    if packed.whole_step is None or not WHOLE_VERIFY:
        return None, "no persistent AR step for this target here, or turned off"
    c = packed.config
    try:
        from kernels.triton_verify_step import PersistentChainVerify
        verifier = PersistentChainVerify(packed.whole_step.weights, c.num_heads, c.head_dim, c.head_v_dim,
                                         c.norm_eps, nodes, tuple(feature_layers),
                                         swish=c.output_gate_activation in ("swish", "silu"),
                                         neg_eigval=c.allow_neg_eigval, programs=WHOLE_STEP_PROGRAMS)
        problem = check_chain_verify(packed, verifier, deferred)
    except Exception as err:  # noqa: BLE001 - any failure: the per-op verification
        problem = f"{type(err).__name__}: {err}"
    if problem:
        return None, f"chain-verify kernel unusable: {problem}"
    return verifier, f"verification as one persistent launch ({verifier.programs} programs)"


@torch.no_grad()
def check_chain_verify(packed, verifier, deferred: bool, seed: int = 0) -> str | None:
    """Verify a random chain, then a random tree of as many nodes, from a random state (and
    pending commit) with the persistent kernel and with the op set's tree forward; None if
    logits, normed rows, features, the folded state and the factors agree, else what differs."""
    from specla.tree import DraftTree
    n = verifier.nodes
    problem = _check_draft(packed, verifier, deferred, DraftTree.chain([0] * n, max_nodes=max(n, 1)), seed)
    if problem or n < 3:
        return problem
    tree = DraftTree([0] * n, [-1] + [(i - 1) // 2 for i in range(1, n)])     # a binary tree: branches at every depth
    problem = _check_draft(packed, verifier, deferred, tree, seed + 1)
    return problem and f"a tree's verification: {problem}"


@torch.no_grad()
def _check_draft(packed, verifier, deferred: bool, tree, seed: int) -> str | None:
    """`check_chain_verify` for one draft shape."""
    from specla.graphs.runtime import StaticState
    from specla.model import Topology
    from specla.verify import verify_layer
    gen = torch.Generator(device="cpu").manual_seed(seed)
    c, n, dev = packed.config, verifier.nodes, packed.device
    L, H, P = c.num_hidden_layers, c.num_heads, 3
    mine = StaticState(c, dev, packed.dtype)
    mine.recurrent.copy_(torch.randn(mine.recurrent.shape, generator=gen) * 0.1)
    mine.conv.copy_(torch.randn(mine.conv.shape, generator=gen))
    theirs = mine.clone()
    pk = torch.randn(L, 1, P, H, c.head_dim, generator=gen)
    pending = tuple(t.to(dev) for t in (pk / pk.norm(dim=-1, keepdim=True),
                                        torch.randn(L, 1, P, H, c.head_v_dim, generator=gen) * 0.1,
                                        -torch.rand(L, 1, P, H, generator=gen) * 0.5)) if deferred else None
    tokens = torch.randint(c.vocab_size, (1, n), generator=gen).to(dev)
    root = tokens[0, :1].clone()
    topo = Topology.of(tree, c.conv_size, dev)
    want_f, got_f = packed.new_factors(n), packed.new_factors(n)

    def verify(l, q, k, v, g, beta, S, out):
        return verify_layer("chain" if tree.is_chain else "tree", q, k, v, g, beta, S, topo, pending=None if pending is None
                            else tuple(t[l] for t in pending), out=out)

    layers = verifier.feature_layers
    want_logits, want_hidden, want_feats = packed.tree_forward(tokens, theirs, topo.conv_index, verify, want_f, layers)
    logits = torch.zeros(n, c.vocab_size, device=dev)
    hidden = torch.zeros(n, c.hidden_size, device=dev, dtype=packed.dtype)
    feats = torch.zeros(n, len(layers), c.hidden_size, device=dev, dtype=packed.dtype) if layers else None
    verifier(tokens, root, mine.conv, mine.recurrent, pending, logits, hidden, feats,
             (got_f.k, got_f.g, got_f.delta, got_f.conv_in), tree=None if tree.is_chain else (topo.parents, topo.conv_index))
    tol = 1e-3 if packed.dtype == torch.float32 else 5e-2
    pairs = [("logits", logits, want_logits), ("normed rows", hidden, want_hidden), ("state", mine.recurrent,
             theirs.recurrent)] + [(name, getattr(got_f, name), getattr(want_f, name)) for name in
                                   ("k", "g", "delta", "conv_in")]
    if feats is not None:
        pairs.append(("features", feats, want_feats))
    return first_difference(pairs, tol) or ("a grid barrier gave up waiting" if verifier.failed() else None)
