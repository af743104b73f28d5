"""The persistent one-launch AR step (kernels/triton_decode_step.py) against
`decode_step_ref`: logits, state, conv cache and the greedy token over several tokens in a
row. On the GPU with a full grid (the barriers synchronise resident programs); on the CPU
through Triton's interpreter with one program, whose barriers pass at once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import reference
from tests.test_kernels import RTOL, needs_cuda, rel_err

REPO = Path(__file__).resolve().parent.parent


def random_weights(L: int, D: int, H: int, K: int, V: int, W: int, I: int, vocab: int, dtype, device,
                   bias: bool, seed: int) -> reference.DecodeWeights:
    gen = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    return reference.DecodeWeights(
        embed=rnd(vocab, D), attn_norm=1 + rnd(L, D, scale=0.1), w_in=rnd(L, C + H * V + 2 * H, D, scale=D ** -0.5),
        conv_w=rnd(L, C, W, scale=0.5), conv_b=rnd(L, C, scale=0.1) if bias else None,
        neg_A=-(torch.rand(L, H, generator=gen) * 2).exp().to(device), dt_bias=rnd(L, H, scale=0.5, dt=torch.float32),
        o_norm=1 + rnd(L, V, scale=0.1), w_o=rnd(L, D, H * V, scale=(H * V) ** -0.5),
        mlp_norm=1 + rnd(L, D, scale=0.1), w_gate_up=rnd(L, 2 * I, D, scale=D ** -0.5),
        w_down=rnd(L, D, I, scale=I ** -0.5), final_norm=1 + rnd(D, scale=0.1), lm_head=rnd(vocab, D, scale=D ** -0.5))


def check_decode_step(L: int, D: int, H: int, K: int, V: int, W: int, I: int, vocab: int, dtype, device,
                      bias: bool = False, neg_eigval: bool = False, programs: int | None = None,
                      steps: int = 3, seed: int = 0) -> list[str]:
    """`steps` greedy tokens through the kernel and the reference from one random state; the
    kernel's own state, cache and next token carry over, so a stale read or a missed barrier
    shows in the later tokens."""
    from kernels.triton_decode_step import PersistentDecodeStep
    wt = random_weights(L, D, H, K, V, W, I, vocab, dtype, device, bias, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    C = H * (2 * K + V)
    cache = torch.randn(L, 1, C, W, generator=gen).to(device=device, dtype=dtype)
    S = (torch.randn(L, 1, H, K, V, generator=gen) * 0.1).to(device)
    S_ref, cache_ref = S.cpu().clone(), cache.cpu().clone()
    wt_cpu = reference.DecodeWeights(**{k: None if v is None else v.cpu() for k, v in vars(wt).items()})
    step = PersistentDecodeStep(wt, H, K, V, 1e-6, neg_eigval=neg_eigval, programs=programs)
    token = torch.tensor([[3]], device=device)
    out = torch.full((8,), -1, device=device)
    count = torch.zeros(1, dtype=torch.long, device=device)
    logits = torch.empty(vocab, device=device)
    problems, fed = [], 3
    # fp32: the order of sums only; bf16: each projection's output is rounded to bf16 (and
    # the interpreter truncates where the GPU rounds to nearest), compounded over the layers
    tol = RTOL if dtype == torch.float32 else 4e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 2e-2
    for t in range(steps):
        step(token, cache, S, logits, greedy=(token, out, count))
        want, S_ref, cache_ref = reference.decode_step_ref(fed, wt_cpu, cache_ref, S_ref, 1e-6, K, V,
                                                           neg_eigval=neg_eigval)
        for name, got, ref in (("logits", logits, want), ("state", S, S_ref), ("cache", cache, cache_ref)):
            if rel_err(got, ref) >= tol:
                problems.append(f"token {t}: {name} relative error {rel_err(got, ref):.2e}")
        top2 = want.topk(2).values
        if top2[0] - top2[1] > 1e-2 and int(token) != int(want.argmax()):
            problems.append(f"token {t}: greedy {int(token)}, reference {int(want.argmax())}")
        fed = int(token)
        if int(out[t]) != fed:
            problems.append(f"token {t}: out[{t}] = {int(out[t])}, not the fed token {fed}")
    if int(count) != steps:
        problems.append(f"count {int(count)} after {steps} steps")
    if step.failed():
        problems.append("a barrier gave up waiting")
    return problems


SHAPES = {   # L, D, H, K, V, W, I, vocab
    "tiny": (2, 64, 2, 16, 16, 4, 64, 96),
    "embedded": (6, 384, 6, 64, 64, 4, 1024, 4096),
    "wide-heads": (2, 256, 2, 128, 128, 4, 512, 1000),
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("programs", [None, 7])
def test_decode_step_matches_reference(shape, dtype, programs):
    assert not check_decode_step(*SHAPES[shape], dtype, "cuda", bias=shape == "tiny",
                                 neg_eigval=shape == "wide-heads", programs=programs, steps=4)


def test_decode_step_rejects_bad_shapes():
    pytest.importorskip("triton")
    from kernels.triton_decode_step import PersistentDecodeStep
    wt = random_weights(1, 32, 2, 16, 16, 4, 32, 40, torch.float32, "cpu", False, 0)
    with pytest.raises(ValueError, match="do not fit"):
        PersistentDecodeStep(wt, 3, 16, 16, 1e-6)
    with pytest.raises(ValueError, match="powers of two"):
        PersistentDecodeStep(random_weights(1, 32, 2, 16, 12, 4, 32, 40, torch.float32, "cpu", False, 0),
                             2, 16, 12, 1e-6)


def run_interpreted(script: str) -> str:
    """`script --interpreter` under Triton's CPU interpreter; its output, once it exited 0."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, script, "--interpreter"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_decode_step_interpreter():
    """One program through Triton's CPU interpreter: the phases' arithmetic and the barriers'
    bookkeeping (the counter re-armed after each launch)."""
    assert run_interpreted(__file__).count("ok ") == 3


def check_packed_target(dtype) -> list[str]:
    """The runtime's side: a random model packed for decoding, its layers stacked (and left
    as views of the stacks), the whole step against the packed target's own AR forward."""
    from kernels.triton_decode_step import PersistentDecodeStep
    from specla.graphs.runtime import PackedTarget
    from specla.graphs.whole_step import check_whole_step, stack_weights
    from tests.helpers import random_target
    target = random_target(vocab=64, hidden=64, std=0.2).to(dtype)
    packed = PackedTarget(target, ops="torch")
    c = packed.config
    before = packed.layers[1].w_in.clone()
    step = PersistentDecodeStep(stack_weights(packed), c.num_heads, c.head_dim, c.head_v_dim, c.norm_eps,
                                programs=1)
    problems = [] if torch.equal(packed.layers[1].w_in, before) else ["stacking changed a layer's weights"]
    problem = check_whole_step(packed, step)
    return problems + ([problem] if problem else [])


if __name__ == "__main__":
    if sys.argv[1:] != ["--interpreter"] or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"usage: TRITON_INTERPRET=1 python {sys.argv[0]} --interpreter")
    failed = 0
    for dtype in (torch.float32, torch.bfloat16):
        problems = check_decode_step(*SHAPES["tiny"], dtype, "cpu", bias=dtype == torch.float32,
                                     neg_eigval=dtype == torch.bfloat16, programs=1)
        print(("FAIL " if problems else "ok ") + str(dtype) + " " + "; ".join(problems))
        failed += bool(problems)
    problems = check_packed_target(torch.float32)
    print(("FAIL " if problems else "ok ") + "packed target " + "; ".join(problems))
    failed += bool(problems)
    sys.exit(1 if failed else 0)
