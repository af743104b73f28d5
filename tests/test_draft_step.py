"""The persistent one-launch block draft (kernels/triton_draft_step.py) against the device
block drafter's torch path, its reference: over several steps in a row (the window filled
and wrapped, a first draft that appends nothing), the slot logits, slot hiddens, top-k,
and the window's fused rows, validity and raw keys and values. On the GPU with a full grid
and with a few programs; on the CPU through Triton's interpreter with one program."""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from specla.drafters import new_drafter
from specla.drafters.base import DraftSettings
from specla.drafters.lilicorr import candidates
from tests.helpers import random_target
from tests.test_decode_step import run_interpreted
from tests.test_kernels import needs_cuda, rel_err

BLOCK, WINDOW, VOCAB = 6, 16, 128


def drafter_pair(dtype, device, kind: str = "block", seed: int = 0):
    """A random target and a device block drafter (its torch path) small enough for the CPU."""
    from specla.graphs.drafters import DeviceBlockDrafter
    target = random_target(vocab=VOCAB, hidden=64, std=0.2).to(device=device, dtype=dtype)
    torch.manual_seed(seed)
    kw = dict(width=64, heads=2, mlp_hidden=96, window=WINDOW)
    if kind == "lilicorr":
        kw["head"] = dict(width=32, heads=2, mlp_hidden=64)
    drafter = new_drafter(kind, target, feature_layers=(0, 1), block_size=BLOCK, top_k=4, **kw)
    for p in drafter.net.parameters():        # trained-like norms, not all ones
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    settings = DraftSettings(tree="chain", block_size=BLOCK, top_k=4, budget=BLOCK - 1)
    return DeviceBlockDrafter(drafter, settings, persistent=False)


def check_block_draft(dtype, device, programs: int | None = None, steps: int = 6, seed: int = 0,
                      blocks: dict[str, int] | None = None, tree: bool = False) -> list[str]:
    """`steps` drafts in a row by the kernel and by the torch path from the same window; with
    `tree`, the kernel also grows the best-first tree over its candidates (`TreeOut`), checked
    against `grow_tree` on them (tests/test_draft_tree.py)."""
    from kernels.triton_draft_step import PersistentBlockDraft
    from specla.graphs.draft_step import draft_weights
    dev = drafter_pair(dtype, device, seed=seed)
    c, parts = dev.net.config, dev.parts
    kernel = PersistentBlockDraft(draft_weights(dev.net, parts), c.heads, c.window, c.block_size, dev.slots,
                                  dev.top_k, dev.net.norm.eps, parts.norm_eps, programs=programs, blocks=blocks)
    gen = torch.Generator().manual_seed(seed + 1)
    F, D = len(dev.feature_layers), parts.hidden_size
    feats = lambda n: (torch.randn(n, F, D, generator=gen) * 2).to(device=device, dtype=dtype)  # noqa: E731
    dev.reset(list(range(5)), feats(5))
    window = (dev.ctx.clone(), dev.valid.clone(), dev.kv_stack.clone())
    S, k = dev.slots, dev.top_k
    h, logits = torch.zeros(BLOCK - 1, c.width, device=device, dtype=dtype), torch.zeros(BLOCK - 1, VOCAB, device=device)
    cand, cand_logp = torch.zeros(S, k, dtype=torch.long, device=device), torch.zeros(S, k, device=device)
    # a fixed tree's tokens (slot, rank per node: several per slot, ranks past the top-1) and its
    # step-log row, written by the kernel into a log of 3 rows
    from kernels.triton_draft_step import ChainOut
    picks = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 2), (3, 0), (0, 3)]
    flat = torch.tensor([slot * k + rank for slot, rank in picks], device=device)
    log_rows, drafted = 3, len(picks)
    nodes = drafted + 2
    chain = ChainOut(torch.full((drafted + 1,), -7, device=device), flat, torch.zeros(1, dtype=torch.long, device=device),
                     torch.zeros(log_rows, S, k, dtype=torch.long, device=device), torch.zeros(log_rows, S, k, device=device),
                     torch.full((log_rows, nodes), 9.0, device=device), 0.5)
    if tree:
        from kernels.triton_draft_step import TreeOut
        from tests.test_draft_tree import CONV
        nodes = 9
        chain = TreeOut(torch.full((nodes,), -7, device=device), torch.zeros(nodes, dtype=torch.long, device=device),
                        torch.zeros(nodes, CONV, dtype=torch.long, device=device), chain.step, chain.cand,
                        chain.cand_logp, torch.full((log_rows, nodes + 1), 9.0, device=device), 0.5)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    rng, problems = random.Random(seed), []
    for step in range(steps):
        a = -1 if step == 0 else rng.randrange(BLOCK)
        path = rng.sample(range(BLOCK), BLOCK)
        result = torch.tensor([a, 0, 0] + path, device=device)
        features = feats(BLOCK)
        root = torch.tensor([rng.randrange(VOCAB)], device=device)
        if a >= 0:
            dev.observe_rows(result, features)
        want_h, want_logits = dev.slot_logits(root)
        want_cand, want_logp = candidates(want_logits[0], k)
        chain.step.fill_(step + 1)                   # past the log's last row: clamped to it
        kernel(root, result, features if a >= 0 else None, *window, h, logits, cand, cand_logp, chain)
        row = min(step + 1, log_rows - 1)
        if tree:
            from tests.test_draft_tree import reference
            want_tokens, want_parents, tree_logp, want_index = reference(cand, cand_logp, nodes)
            want_row = torch.cat([tree_logp * 0.5, torch.zeros(1, device=device)])
            if not (torch.equal(chain.tokens[1:], want_tokens[1:]) and torch.equal(chain.parents, want_parents)
                    and torch.equal(chain.conv_index, want_index) and torch.equal(chain.draft_logp[row], want_row)
                    and torch.equal(chain.cand[row], cand)):
                problems.append(f"step {step}: the best-first tree or its log row is not grow_tree's")
        else:
            want_row = torch.zeros(nodes, device=device)
            want_row[1:drafted + 1] = cand_logp.view(-1)[flat] * 0.5
            if not (torch.equal(chain.tokens[1:], cand.view(-1)[flat]) and torch.equal(chain.cand[row], cand)
                    and torch.equal(chain.cand_logp[row], cand_logp) and torch.equal(chain.draft_logp[row], want_row)):
                problems.append(f"step {step}: the draft or its log row is not the picked candidates and their "
                                "log-probs")
        if int(chain.tokens[0]) != -7:
            problems.append(f"step {step}: the chain's root was written")
        checks = {"slot logits": (logits[:S], want_logits[0]), "slot hiddens": (h[:S], want_h[0]),
                  "top-k log-probs": (cand_logp, want_logp), "window rows": (window[0], dev.ctx),
                  "window keys and values": (window[2], dev.kv_stack)}
        for name, (got, want) in checks.items():
            err = rel_err(got.float(), want.float())
            if not err < tol:
                problems.append(f"step {step} (a={a}): {name} relative error {err:.2e}")
        if not torch.equal(window[1], dev.valid):
            problems.append(f"step {step}: window validity {window[1].tolist()} != {dev.valid.tolist()}")
        # a different pick only where the torch path's own log-probs tie within the tolerance
        for s in range(S):
            got_tok, want_tok = int(cand[s, 0]), int(want_cand[s, 0])
            gap = float(want_logp[s, 0] - torch.log_softmax(want_logits[0, s].float(), -1)[got_tok])
            if got_tok != want_tok and gap > 10 * tol:
                problems.append(f"step {step}: slot {s} picked {got_tok}, not {want_tok} (gap {gap:.3g})")
    if kernel.failed():
        problems.append("a barrier gave up waiting")
    return problems


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("programs", [None, 5])
def test_block_draft_matches_torch_path(dtype, programs):
    assert not check_block_draft(dtype, "cuda", programs=programs)


@needs_cuda
@pytest.mark.parametrize("programs", [None, 3])
def test_block_draft_grows_the_best_first_tree(programs):
    assert not check_block_draft(torch.bfloat16, "cuda", programs=programs, tree=True)


@needs_cuda
def test_block_draft_in_the_device_drafter():
    """The drafter picks the kernel on CUDA, checks it, and drafts with it in a captured step."""
    dev = drafter_pair(torch.bfloat16, "cuda")
    from specla.graphs.drafters import DeviceBlockDrafter
    from specla.drafters.block import BlockDrafter
    host = BlockDrafter(dev.net, dev.parts)
    on = DeviceBlockDrafter(host, dev.settings)
    assert on.kernel is not None and on.draft_note == "one persistent launch"
    off = DeviceBlockDrafter(host, dev.settings, persistent=False)
    assert off.kernel is None and "off" in off.draft_note


def test_block_draft_bad_input():
    pytest.importorskip("triton")
    from kernels.triton_draft_step import PersistentBlockDraft, unsupported
    from specla.graphs.draft_step import draft_weights
    assert "head width" in unsupported(dict(WD=64, HD=16, MH=96, W=16, B=6))
    assert "window" in unsupported(dict(WD=64, HD=32, MH=96, W=4, B=6))
    dev = drafter_pair(torch.float32, "cpu")
    c = dev.net.config
    with pytest.raises(ValueError, match="slots"):
        PersistentBlockDraft(draft_weights(dev.net, dev.parts), c.heads, c.window, c.block_size, BLOCK, 4, 1e-6, 1e-6,
                             programs=1)
    with pytest.raises(ValueError, match="no tiles"):
        PersistentBlockDraft(draft_weights(dev.net, dev.parts), c.heads, c.window, c.block_size, 3, 4, 1e-6, 1e-6,
                             programs=1, blocks={"BX": 1})


def test_block_draft_interpreter():
    """One program through Triton's CPU interpreter, fp32 and bf16, several steps in a row;
    then a best-first tree grown in the launch."""
    assert run_interpreted(__file__).count("ok ") == 3


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    failed = 0
    for dtype in (torch.float32, torch.bfloat16):
        problems = check_block_draft(dtype, "cpu", programs=1, steps=4)
        print("ok " if not problems else "FAILED ", dtype, problems)
        failed += bool(problems)
    problems = check_block_draft(torch.float32, "cpu", programs=1, steps=3, tree=True)
    print("ok " if not problems else "FAILED ", "best-first tree", problems)
    failed += bool(problems)
    sys.exit(1 if failed else 0)
