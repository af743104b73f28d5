"""A block drafter's draft as one persistent launch (`kernels/triton_draft_step.py`).

`block_draft_for` builds the kernel for a `DeviceBlockDrafter` where it applies and checks
it against the drafter's torch path first (the same draft from the same window), so a
kernel that disagrees is never used; the note says which path drafts and why. A draft never
decides an output token (verification does), so the check is about a useful draft, not
exactness: the slot logits within bf16 rounding of the torch path's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from specla.drafters.block import BlockNet, TargetParts

# Draft in one persistent launch wherever the kernel applies.
PERSISTENT_DRAFT = True
# The check's bound on the slot logits' relative error against the torch path: bf16
# roundings through two layers, the order of fp32 sums and the attention's softmax.
CHECK_RTOL = 5e-2


def draft_weights(net: BlockNet, parts: TargetParts):
    """The drafter's weights stacked per layer (copies), and the target's parts (shared)."""
    from kernels.triton_draft_step import BlockDraftWeights

    layers = net.layers
    stack = lambda fn: torch.stack([fn(layer) for layer in layers]).contiguous()  # noqa: E731
    return BlockDraftWeights(
        fc=net.fc.weight.detach().contiguous(), ctx_norm=net.ctx_norm.weight.detach().contiguous(),
        in_proj=net.in_proj.weight.detach().contiguous(), mask_emb=net.mask_emb.detach().contiguous(),
        attn_norm=stack(lambda l: l.attn_norm.weight.detach()),
        w_qkv=stack(lambda l: torch.cat([l.attn.q_proj.weight, l.attn.k_proj.weight, l.attn.v_proj.weight]).detach()),
        qk_norm=stack(lambda l: torch.stack([l.attn.q_norm.weight, l.attn.k_norm.weight]).detach()),
        w_o=stack(lambda l: l.attn.o_proj.weight.detach()), mlp_norm=stack(lambda l: l.mlp_norm.weight.detach()),
        w_gate_up=stack(lambda l: torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]).detach()),
        w_down=stack(lambda l: l.mlp.down_proj.weight.detach()), norm=net.norm.weight.detach().contiguous(),
        out_proj=net.out_proj.weight.detach().contiguous(), embed=parts.embed_weight.contiguous(),
        final_norm=parts.norm_weight.contiguous(), lm_head=parts.lm_weight.contiguous())


def _applies(net: BlockNet, parts: TargetParts, device: torch.device) -> str | None:
    """None if the kernel can draft for this drafter, else why not."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    try:
        from kernels.triton_draft_step import unsupported
    except ImportError as err:
        return f"Triton is not importable ({err})"
    c = net.config
    if net.fc.weight.dtype != parts.lm_weight.dtype:
        return "the drafter and the target's head in different dtypes"
    return unsupported(dict(WD=c.width, HD=c.width // c.heads, MH=c.mlp_hidden, W=c.window, B=c.block_size))


def kernel_or_note(wanted: bool | None, enabled: bool, what: str, why_not: str | None,
                   build: Callable[[], Any], check: Callable[[Any], str | None], note: str) -> tuple[Any, str]:
    """(kernel, note) where a drafter's kernel applies (`why_not` None) and passes its check
    against the torch path, else (None, "torch ops (why not)"). wanted: None where it
    applies (and `enabled`), True the same or a ValueError naming `what`, False never."""
    if wanted is False or (wanted is None and not enabled):
        return None, f"torch ops (the {what} is off)"
    if why_not is None:
        kernel = build()
        why_not = check(kernel)
        if why_not is None:
            return kernel, note
    if wanted:
        raise ValueError(f"the {what} cannot run here: {why_not}")
    return None, f"torch ops ({why_not})"


def block_draft_for(drafter, wanted: bool | None = None):
    """(PersistentBlockDraft, note) for a `DeviceBlockDrafter`, or (None, why not) (`kernel_or_note`)."""
    net, parts, c = drafter.net, drafter.parts, drafter.net.config

    def build():
        from kernels.triton_draft_step import PersistentBlockDraft
        return PersistentBlockDraft(draft_weights(net, parts), c.heads, c.window, c.block_size, drafter.slots,
                                    drafter.top_k, net.norm.eps, parts.norm_eps)
    return kernel_or_note(wanted, PERSISTENT_DRAFT, "persistent block draft", _applies(net, parts, drafter.device),
                          build, lambda kernel: check_block_draft(drafter, kernel), "one persistent launch")


@torch.no_grad()
def check_block_draft(drafter, kernel, accepted: int = 3) -> str | None:
    """The kernel against the drafter's torch path on one step: `accepted` random feature
    rows appended to the drafter's window, then a draft. The drafter's buffers are put back."""
    dev, dtype, c = drafter.device, drafter.ctx.dtype, drafter.net.config
    gen = torch.Generator(device=dev).manual_seed(0)
    F, D = len(drafter.feature_layers), drafter.parts.hidden_size
    features = torch.randn(accepted, F, D, generator=gen, device=dev).to(dtype)
    result = torch.tensor([accepted - 1, 0, 0] + list(range(accepted)), device=dev)
    root = torch.ones(1, dtype=torch.long, device=dev)
    saved = [t.clone() for t in drafter.buffers()]
    window = (drafter.ctx.clone(), drafter.valid.clone(), drafter.kv_stack.clone())
    drafter.observe_rows(result, features)
    _, want = drafter.slot_logits(root)
    want_kv = drafter.kv_stack.clone()
    for t, s in zip(drafter.buffers(), saved):
        t.copy_(s)
    S = drafter.slots
    h = torch.zeros(c.block_size - 1, c.width, device=dev, dtype=dtype)
    logits = torch.zeros(c.block_size - 1, drafter.parts.vocab_size, device=dev)
    cand = torch.zeros(S, drafter.top_k, dtype=torch.long, device=dev)
    kernel(root, result, features, *window, h, logits, cand, torch.zeros(S, drafter.top_k, device=dev))
    if kernel.failed():
        return "a barrier of the draft kernel gave up waiting"
    for name, got, ref in (("slot logits", logits[:S], want[0]), ("window keys", window[2], want_kv)):
        err = float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))
        if not err < CHECK_RTOL:
            return f"its {name} differ from the torch path's (relative error {err:.2e})"
    return None
