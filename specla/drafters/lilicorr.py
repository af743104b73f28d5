"""LiLiCorr: a small head that correlates the block drafter's per-slot candidates.

The block drafter's slots are independent marginals, so its top-1 path can be incoherent
("New" then "Francisco"). For each of the S slots take the top-k candidates c[s, j] with
their log-probs; per candidate

    x = token_proj(E[c]) + hidden_proj(h_s) + mlp(LN[logp, p, logp - max logp, j/(k-1), is_top1])
        + slot_emb[s] + rank_emb[j]

2 transformer layers attend over the whole S x k lattice (a learned relative-slot bias and a
same-slot bias per head). Fusion with one anchor row a (the fused context row of the last
accepted position):

    F = silu(W [x; a; x*a]);  out = normalize(W_out F);  in = normalize(W_in F)
    pair[s, i, j] = 8 <out[s, i], in[s+1, j]>          (S-1 matrices, one batched matmul)
    start[j]      = 8 <normalize(W_a a), in[0, j]>

Selection: at temperature 0 the greedy walk (start argmax, then the argmax of the row out of
the previous pick; not Viterbi, since acceptance rewards a correct prefix); at temperature
> 0 each slot is sampled from the softmax of its row, and q (on the k candidates) goes to
the lossless rejection sampler. Trees: `tree_build` over `tree_rows`, the head's
conditional rows at the block drafter's lattice mass.

Training (jointly with the drafter): block CE + 0.25 lattice CE + 0.25 penalty, where the
lattice CE runs along the true-token prefix (slot s counts while the true token is in the
lattice at s and at every earlier slot) and penalty = E_head[relu(z(true) - z(candidate))]
with z the live target's logits.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specla.drafters import tree_build
from specla.drafters.base import Draft, DraftContext
from specla.drafters.block import BlockDrafter, BlockNet, TargetParts


@dataclasses.dataclass
class HeadConfig:
    drafter_width: int
    target_hidden: int
    width: int = 128
    heads: int = 4
    layers: int = 2
    mlp_hidden: int = 256
    max_slots: int = 15
    max_k: int = 8
    scale: float = 8.0


class LatticeLayer(nn.Module):
    """Pre-LN transformer layer over the flattened lattice, with an additive bias."""

    def __init__(self, width: int, heads: int, mlp_hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.o_proj = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        N, L, W = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(N, L, 3, self.heads, W // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=bias.to(q.dtype))
        x = x + self.o_proj(out.transpose(1, 2).reshape(N, L, W))
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        c = self.config = config
        w = c.width
        self.token_proj = nn.Linear(c.target_hidden, w, bias=False)
        self.hidden_proj = nn.Linear(c.drafter_width, w, bias=False)
        self.feat_norm = nn.LayerNorm(5)
        self.feat_mlp = nn.Sequential(nn.Linear(5, w), nn.SiLU(), nn.Linear(w, w))
        self.slot_emb = nn.Embedding(c.max_slots, w)
        self.rank_emb = nn.Embedding(c.max_k, w)
        self.layers = nn.ModuleList(LatticeLayer(w, c.heads, c.mlp_hidden) for _ in range(c.layers))
        self.rel_slot_bias = nn.Parameter(torch.zeros(c.heads, 2 * c.max_slots - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(c.heads))
        self.anchor_proj = nn.Linear(c.drafter_width, w)
        self.fuse = nn.Linear(3 * w, w)
        self.w_out = nn.Linear(w, w, bias=False)
        self.w_in = nn.Linear(w, w, bias=False)
        self.w_a = nn.Linear(w, w, bias=False)
        for emb in (self.slot_emb, self.rank_emb):
            nn.init.normal_(emb.weight, std=0.02)
        self.reseed()

    def reseed(self) -> None:
        """Re-seed the out/in (and anchor) heads with std 0.02, as the paper does."""
        for lin in (self.w_out, self.w_in, self.w_a):
            nn.init.normal_(lin.weight, std=0.02)

    def attn_bias(self, S: int, k: int, device) -> torch.Tensor:
        """[1, heads, S*k, S*k]: relative-slot bias + same-slot bias (other candidates)."""
        slot = torch.arange(S, device=device).repeat_interleave(k)
        rel = slot[None, :] - slot[:, None] + self.config.max_slots - 1
        bias = self.rel_slot_bias[:, rel]                                   # [H, L, L]
        same = (slot[None, :] == slot[:, None]) & ~torch.eye(S * k, dtype=torch.bool, device=device)
        return (bias + self.same_slot_bias[:, None, None] * same)[None]

    def fused(self, cand_emb: torch.Tensor, cand_logp: torch.Tensor, slot_hidden: torch.Tensor,
              anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """F [N, S, k, w] and the projected anchor a [N, w].

        cand_emb [N, S, k, D] target embeddings of the candidates, cand_logp [N, S, k] the
        drafter's log-probs (sorted best first), slot_hidden [N, S, d], anchor [N, d].
        """
        c = self.config
        N, S, k = cand_logp.shape
        if S > c.max_slots or k > c.max_k:
            raise ValueError(f"lattice {S} slots x {k} candidates exceeds the head's "
                             f"{c.max_slots} x {c.max_k}")
        dtype = self.token_proj.weight.dtype
        logp = cand_logp.float().clamp(min=-30.0)
        rank = torch.arange(k, device=logp.device, dtype=torch.float32)
        feats = torch.stack([logp, logp.exp(), logp - logp[..., :1],
                             (rank / max(k - 1, 1)).expand_as(logp),
                             (rank == 0).float().expand_as(logp)], dim=-1)
        x = (self.token_proj(cand_emb.to(dtype)) + self.hidden_proj(slot_hidden.to(dtype))[:, :, None]
             + self.feat_mlp(self.feat_norm(feats.to(dtype)))
             + self.slot_emb.weight[:S, None] + self.rank_emb.weight[:k])
        x = x.reshape(N, S * k, -1)
        bias = self.attn_bias(S, k, x.device)
        for layer in self.layers:
            x = layer(x, bias)
        x = x.view(N, S, k, -1)
        a = self.anchor_proj(anchor.to(dtype))
        ab = a[:, None, None].expand_as(x)
        return F.silu(self.fuse(torch.cat([x, ab, x * ab], dim=-1))), a

    def forward(self, cand_emb: torch.Tensor, cand_logp: torch.Tensor, slot_hidden: torch.Tensor,
                anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """start [N, k] and pair [N, S-1, k, k] scores (fp32)."""
        Fx, a = self.fused(cand_emb, cand_logp, slot_hidden, anchor)
        out = F.normalize(self.w_out(Fx).float(), dim=-1)
        inn = F.normalize(self.w_in(Fx).float(), dim=-1)
        s = self.config.scale
        pair = s * torch.matmul(out[:, :-1], inn[:, 1:].transpose(-1, -2))
        start = s * torch.einsum("nw,njw->nj", F.normalize(self.w_a(a).float(), dim=-1), inn[:, 0])
        return start, pair


class Lattice(NamedTuple):
    """The candidate lattice and the head's scores over it."""
    cand: torch.Tensor          # [N, S, k] tokens, each slot's top-k, best first
    cand_logp: torch.Tensor     # [N, S, k] their block-drafter log-probs
    start: torch.Tensor         # [N, k] scores of slot 0's candidates
    pair: torch.Tensor          # [N, S-1, k, k] scores of (slot s candidate i, slot s+1 candidate j)


def lattice(parts: TargetParts, head: LiLiCorrHead, logits: torch.Tensor, h: torch.Tensor,
            anchor: torch.Tensor, k: int) -> Lattice:
    """Candidates and scores from slot logits [N, S, V] and slot hiddens h [N, S, d]."""
    cand, cand_logp = candidates(logits, k)
    start, pair = head(parts.embed(cand), cand_logp, h, anchor)
    return Lattice(cand, cand_logp, start, pair)


def candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's top-k tokens and their log-probs (sorted best first) from [..., V] logits."""
    top = torch.log_softmax(logits.float(), dim=-1).detach().topk(k, dim=-1)
    return top.indices, top.values


def greedy_walk(start: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """Ranks [..., S]: start argmax, then the argmax of the row out of the previous pick."""
    picks = [start.argmax(-1)]
    for s in range(pair.shape[-3]):
        row = pair[..., s, :, :].gather(-2, picks[-1][..., None, None].expand(
            *picks[-1].shape, 1, pair.shape[-1]))[..., 0, :]
        picks.append(row.argmax(-1))
    return torch.stack(picks, dim=-1)


def conditional_rows(start: torch.Tensor, pair: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """Scores [..., S, k] of each slot's row given the previous slot's rank in `ranks`."""
    rows = [start]
    for s in range(pair.shape[-3]):
        rows.append(pair[..., s, :, :].gather(-2, ranks[..., s, None, None].expand(
            *ranks.shape[:-1], 1, pair.shape[-1]))[..., 0, :])
    return torch.stack(rows, dim=-2)


# The head's rows are flattened a little for tree search: chosen among 0.5, 0.75 and 1 on
# held-out prompts 33-64, apart from the 32 prompts the results report
# (benchmarks/results/lilicorr_tree_variants_tuning.md).
TREE_SHARPNESS = 0.75


def tree_rows(start: torch.Tensor, pair: torch.Tensor, cand_logp: torch.Tensor,
              sharpness: float = TREE_SHARPNESS) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional log-probs for tree search: the root's children [k] and, for each slot
    s >= 1, the children of a parent of rank i at slot s-1 [S-1, k, k].

        row(s, i) = m_s + log_softmax(sharpness * pair[s-1, i, :])     (start at s = 0)

    start [k] and pair [S-1, k, k] are the head's scores, cand_logp [S, k] the block
    drafter's log-probs of the candidates, m_s = logsumexp(cand_logp[s]) its probability
    that slot s's true token is among them. The head ranks the candidates given the
    parent; the drafter's mass says how likely any of them is right at all, so a path
    through a slot the drafter is unsure of scores low whatever the head says, and
    best-first spends its nodes where they pay. Within a row the order is the head's, so
    the chain (the first child at every depth) is the greedy walk.

    Example (k = 2, S = 2): cand_logp = log [[0.6, 0.2], [0.3, 0.3]], start = [0, ln 3],
    pair[0] = [[0, 0], [ln 4, 0]], sharpness 1: the root's row is log [0.2, 0.6]; out of
    rank 0 the row is log [0.3, 0.3], out of rank 1 log [0.48, 0.12].
    """
    if not sharpness > 0:
        raise ValueError(f"LiLiCorr tree sharpness must be > 0, got {sharpness}")
    k = start.shape[-1]
    scores = torch.cat([start.float().expand(1, k, k), pair.float()], dim=0)  # [S, k_parent, k]
    mass = torch.logsumexp(cand_logp.float(), -1)[:, None, None]
    rows = mass + torch.log_softmax(sharpness * scores, -1)
    return rows[0, 0], rows[1:]


def sampled_walk(start: torch.Tensor, pair: torch.Tensor, temperature: float,
                 generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor]:
    """One path sampled slot by slot from softmax(row / T); returns ranks and q [S, k]."""
    start, pair = start.float().cpu(), pair.float().cpu()
    row, ranks, qs = start, [], []
    for s in range(pair.shape[0] + 1):
        q = torch.softmax(row / temperature, dim=-1)
        j = int(torch.multinomial(q, 1, generator=generator))
        ranks.append(j)
        qs.append(q)
        if s < pair.shape[0]:
            row = pair[s, j]
    return ranks, torch.stack(qs)


def prefix_len(hit: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix along the last dim."""
    return hit.long().cumprod(-1).sum(-1)


def lattice_losses(start: torch.Tensor, pair: torch.Tensor, cand: torch.Tensor, true: torch.Tensor,
                   target_logits: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Lattice CE on the true-token prefix, the target-logit penalty, and metrics.

    start [N,k], pair [N,S-1,k,k], cand [N,S,k], true [N,S] tokens, target_logits [N,S,V]
    (the live target's logits for each slot's token, given the true prefix).
    """
    match = cand == true[..., None]                            # [N, S, k]
    in_lat = match.any(-1)
    idx = match.float().argmax(-1)                             # rank of the true token (0 if absent)
    prefix = in_lat.long().cumprod(-1).bool()                  # slot counts: true in lattice so far
    rows = conditional_rows(start, pair, idx)                  # [N, S, k] rows out of the true parent
    ce = F.cross_entropy(rows.flatten(0, 1), idx.flatten(), reduction="none").view(idx.shape)
    count = prefix.sum().clamp_min(1)
    out = {"lattice_ce": (ce * prefix).sum() / count}
    # A row exists where the parent chain is the truth: slot 0 always, slot s if prefix[s-1].
    has_row = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], dim=1)
    if target_logits is not None:
        z = target_logits.float()
        z_true = z.gather(-1, true[..., None])
        z_cand = z.gather(-1, cand)
        gap = torch.relu(z_true - z_cand)                      # 0 for the true token itself
        pen = (torch.softmax(rows, dim=-1) * gap).sum(-1)
        out["penalty"] = (pen * has_row).sum() / has_row.sum().clamp_min(1)
    with torch.no_grad():
        chosen = greedy_walk(start, pair)
        chosen_tok = cand.gather(-1, chosen[..., None])[..., 0]
        out["selected_prefix"] = prefix_len(chosen_tok == true).float().mean()
        out["top1_prefix"] = prefix_len(cand[..., 0] == true).float().mean()
        out["oracle_prefix"] = prefix_len(in_lat).float().mean()
        out["slot_acc"] = (cand[..., 0] == true).float().mean()
        out["lattice_slot_acc"] = ((chosen_tok == true) & has_row).float().sum() / has_row.sum().clamp_min(1)
    return out


class LiLiCorrDrafter(BlockDrafter):
    """Block drafter + LiLiCorr head: chains by the greedy / sampled walk of the head, trees
    by expansion over `tree_rows(..., tree_sharpness)`."""

    static_rows = False         # a child's row is the pair scores under its parent's rank

    kind = "lilicorr"

    def __init__(self, net: BlockNet, parts: TargetParts, train_top_k: int | None = None,
                 tree_sharpness: float = TREE_SHARPNESS):
        if net.head is None:
            raise ValueError("a LiLiCorr drafter needs a block net with a head")
        super().__init__(net, parts, train_top_k)
        self.tree_sharpness = tree_sharpness

    def propose(self, ctx: DraftContext) -> Draft:
        s = ctx.settings
        S = self._check(s)
        k = s.top_k
        max_k = self.net.head.config.max_k
        if k > max_k:
            raise ValueError(f"this LiLiCorr head takes at most {max_k} candidates per slot; "
                             f"top-k {k} was asked")
        h, logits = self._slots(ctx.root_token)
        anchor = self.ctx[-1:] if len(self.ctx) else torch.zeros_like(h[:1])
        with torch.no_grad():
            cand, cand_logp, start, pair = lattice(self.parts, self.net.head, logits[None, :S],
                                                   h[None, :S], anchor, k)
        cand, cand_logp = cand[0].cpu(), cand_logp[0].cpu()
        start, pair = start[0].cpu(), pair[0].cpu()
        tokens = cand.tolist()
        proposal = None
        if s.temperature > 0 and s.tree == "chain":
            ranks, q = sampled_walk(start, pair, s.temperature, ctx.generator)
            expand = self._fixed_path(tokens, ranks, q)
        else:
            expand = self._rows(tokens, *tree_rows(start, pair, cand_logp, self.tree_sharpness))
        tree, nodes = tree_build.build_tree(ctx.root_token, expand, shape=s.tree, top_k=k,
                                            budget=s.budget, max_depth=S, prune_tau=s.prune_tau)
        if s.temperature > 0 and s.tree == "chain":
            proposal = torch.zeros(len(tree), self.parts.vocab_size, dtype=torch.float32)
            for i, node in enumerate(nodes[1:], start=1):
                proposal[i, cand[node.depth - 1]] = q[node.depth - 1]
            proposal = proposal.to(logits.device)
            chosen = ranks
        else:
            chosen = greedy_walk(start, pair).tolist()
        details = {"drafter": self.kind, "lattice": {
            "candidates": tokens,
            "logprobs": cand_logp.tolist(),
            "start": start.tolist(),
            "pair": pair.tolist(),
            "chosen": [int(r) for r in chosen],
            "top1": [0] * S,
        }}
        return Draft(tree=tree, proposal=proposal, details=details)

    @staticmethod
    def _rows(tokens: list[list[int]], start_lp: torch.Tensor, pair_lp: torch.Tensor):
        """Children of a node at depth d (payload = its rank): its row of conditional
        log-probs (`tree_rows`), best first."""
        order_start = start_lp.argsort(descending=True).tolist()
        order_pair = pair_lp.argsort(dim=-1, descending=True).tolist()
        start_lp, pair_lp = start_lp.tolist(), pair_lp.tolist()

        def expand(nodes):
            rows = []
            for node in nodes:
                d = node.depth
                if d >= len(tokens):
                    rows.append([])
                elif d == 0:
                    rows.append([(tokens[0][j], start_lp[j], j) for j in order_start])
                else:
                    i = node.payload
                    rows.append([(tokens[d][j], pair_lp[d - 1][i][j], j) for j in order_pair[d - 1][i]])
            return rows
        return expand

    @staticmethod
    def _fixed_path(tokens: list[list[int]], ranks: list[int], q: torch.Tensor):
        """The sampled path, one child per depth, with log q of each pick."""
        def expand(nodes):
            rows = []
            for node in nodes:
                d = node.depth
                if d >= len(ranks):
                    rows.append([])
                else:
                    j = ranks[d]
                    rows.append([(tokens[d][j], float(q[d, j].clamp_min(1e-30).log()), j)])
            return rows
        return expand

    def checkpoint_meta(self) -> dict:
        meta = super().checkpoint_meta()
        meta["head"] = dataclasses.asdict(self.net.head.config)
        return meta
