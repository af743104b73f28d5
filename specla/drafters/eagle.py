"""EAGLE-style drafter (SpecLA section 6.2): one decoder layer, run autoregressively over a tree.

A row for position p reads the token x_p and the hidden that predicted it:

    r_p = fc([E(x_p); H_{p-1}])  ->  one decoder layer  ->  o_p  ->  target norm + LM head  ->  x_{p+1}

H is the target's last hidden (after its final norm) for accepted positions; inside the tree
a node's row uses its parent's *drafted* hidden norm(o_parent) instead. Attention sees the
rows of the last W accepted positions, the root row and the node's own tree ancestors
(positions relative to the root, RoPE). The drafter keeps only accepted rows: the root row
r_T = fc([E(root); H_{T-1}]) is built from accepted data, and `observe` appends the rows of
the accepted tokens (root included) from the target's hiddens, never the drafted ones.

Trees: `tree_build` expands one depth per drafter call (the frontier as a batch of
queries), top-k children per node (default 4), depth settings.depth, confidence pruning and
the budget. Training unrolls a few steps ("training-time test"): step u feeds the previous
step's drafted hiddens and attends exactly as a depth-u node does at inference.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from specla.cpu_linear import Linear
from specla.drafters import tree_build
from specla.drafters.base import Accepted, Draft, DraftContext, DraftSettings
from specla.drafters.block import Layer, TargetParts, rope


@dataclasses.dataclass
class EagleConfig:
    target_hidden: int
    vocab_size: int
    heads: int = 6
    mlp_hidden: int = 1024
    window: int = 64

    @property
    def width(self) -> int:
        return self.target_hidden


class EagleNet(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        c = self.config = config
        self.fc = Linear(2 * c.target_hidden, c.width, bias=False)
        self.layer = Layer(c.width, c.heads, c.mlp_hidden)

    def rows(self, parts: TargetParts, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc([E(token); hidden]) for tokens [...] and hiddens [..., D]."""
        dtype = self.fc.weight.dtype
        return self.fc(torch.cat([parts.embed(tokens).to(dtype), hidden.to(dtype)], dim=-1))

    def raw_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys before RoPE and values of rows: position-free, so a drafter keeps them."""
        return self.layer.attn.raw_keys(self.layer.attn_norm(rows))

    def kv(self, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.attn.keys(self.layer.attn_norm(rows), pos)

    def attend(self, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The layer's output o for query rows [N, T, D] over keys k, v [N, S, H, Dh]."""
        layer = self.layer
        x = rows + layer.attn.attend(layer.attn_norm(rows), pos, k, v, mask)
        return x + layer.mlp(layer.mlp_norm(x))

    def unrolled(self, parts: TargetParts, tokens: torch.Tensor, hidden: torch.Tensor,
                 steps: int, window: int | None = None) -> list[torch.Tensor]:
        """Training forward: outputs o of `steps` unrolled steps over whole sequences.

        tokens [B, L], hidden [B, L, D] (target last hidden). Query i stands for position
        p = i + 1 (row r_p = fc([E(x_p); H_{p-1}])). At step u, query i is the depth-(u-1) node
        of a tree whose root is query i-u+1 (its output drafts depth u): it sees the step-1
        (teacher) rows i-u+1-W <= j <= i-u+1 (W accepted rows and the root) and the step-v
        rows at j = i-u+v for 2 <= v <= u (its drafted ancestors and itself).
        Returns o_u [B, L-1, D] for u = 1..steps. At every step o_u[:, i] predicts x_{i+2}
        (the token after position i+1: target logits at i+1 are its label); queries without
        a tree root (i < u-1) are padding.
        """
        W = window or self.config.window
        B, L = tokens.shape
        n = L - 1
        dev = tokens.device
        pos = torch.arange(n, device=dev)
        i = pos[:, None]
        j = pos[None, :]
        rows = self.rows(parts, tokens[:, 1:], hidden[:, :-1])
        ks, vs, outs = [], [], []
        for u in range(1, steps + 1):
            k, v = self.kv(rows, pos)
            ks.append(k)
            vs.append(v)
            root = i - u + 1
            blocks = [(j <= root) & (j >= root - W)]   # W accepted rows + the root, as at inference
            blocks += [j == i - u + w for w in range(2, u + 1)]
            mask = torch.cat(blocks, dim=1)
            mask = mask | ~mask.any(1, keepdim=True)   # rows with no tree root: unused, keep finite
            o = self.attend(rows, pos, torch.cat(ks, 1), torch.cat(vs, 1), mask[None, None])
            outs.append(o)
            if u < steps:   # next step's rows: the same tokens, the previous drafted hiddens
                fed = parts.norm(o.detach())
                fed = torch.cat([torch.zeros_like(fed[:, :1]), fed[:, :-1]], dim=1)
                rows = self.rows(parts, tokens[:, 1:], fed)
        return outs


class EagleDrafter:
    kind = "eagle"

    def __init__(self, net: EagleNet, parts: TargetParts, train_top_k: int | None = None):
        self.net = net.eval()
        self.parts = parts
        self.name = self.kind
        self.feature_layers: tuple[int, ...] = ()
        self.train_top_k = train_top_k
        self._clear()

    def _clear(self) -> None:
        w = self.net.fc.weight
        self.rows = torch.zeros(0, self.net.config.width, device=w.device, dtype=w.dtype)
        with torch.no_grad():  # raw keys/values of the accepted rows, projected once each
            self.rows_kv = self.net.raw_kv(self.rows)
        self.h_last = torch.zeros(self.net.config.target_hidden, device=w.device, dtype=w.dtype)

    # -- state: rows of accepted positions, and the last accepted hidden -----------------
    def _append(self, tokens: list[int], hidden_before: torch.Tensor) -> None:
        """Rows of accepted tokens x_p with the hiddens H_{p-1} that predicted them."""
        window = self.net.config.window
        tokens, hidden_before = tokens[-window:], hidden_before[-window:]
        if not tokens:
            return
        dev = self.rows.device
        with torch.no_grad():
            new = self.net.rows(self.parts, torch.tensor(tokens, device=dev), hidden_before.to(dev))
            new_kv = self.net.raw_kv(new)
        self.rows = torch.cat([self.rows, new])[-window:]
        self.rows_kv = tuple(torch.cat([old, add])[-window:] for old, add in zip(self.rows_kv, new_kv))

    def reset(self, prompt_tokens: list[int], features: torch.Tensor | None,
              last_hidden: torch.Tensor) -> None:
        self._clear()
        T = len(prompt_tokens) - 1
        if T >= 1:
            if last_hidden.shape[0] != T:
                raise ValueError(f"reset got {last_hidden.shape[0]} hiddens for {T} prefilled tokens")
            self._append(prompt_tokens[1:T], last_hidden[:T - 1])
            self.h_last = last_hidden[T - 1].to(self.rows.device, self.rows.dtype)

    def observe(self, accepted: Accepted) -> None:
        hidden = accepted.last_hidden.to(self.rows.device, self.rows.dtype)
        before = torch.cat([self.h_last[None], hidden[:-1]])
        self._append(list(accepted.tokens), before)
        self.h_last = hidden[-1]

    def context_state(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows.clone(), "h_last": self.h_last.clone()}

    # -- drafting -------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> Draft:
        s: DraftSettings = ctx.settings
        s.validate(self.parts.vocab_size)
        search = _TreeSearch(self, ctx)
        tree, nodes = tree_build.build_tree(ctx.root_token, search.expand, shape=s.tree,
                                            top_k=s.top_k, budget=s.budget, max_depth=s.depth,
                                            prune_tau=s.prune_tau)
        proposal = None
        if search.sampling:
            proposal = torch.zeros(len(tree), self.parts.vocab_size, dtype=torch.float32,
                                   device=self.rows.device)
            for i, node in enumerate(nodes[1:], start=1):
                proposal[i] = search.q[node.payload[1]]
        return Draft(tree=tree, proposal=proposal, details={"drafter": self.kind})

    def checkpoint_meta(self) -> dict:
        c = self.net.config
        return {"config": dataclasses.asdict(c), "feature_layers": [], "block_size": None,
                "top_k": self.train_top_k, "window": c.window}


class _TreeSearch:
    """One propose call: runs the layer depth by depth over the frontier with tree attention.

    Node payloads are (processed slot of the parent, q-row id or None); the root is processed
    first. Keys: accepted rows (all visible), then processed nodes (visible if ancestors),
    then the frontier (each sees itself).
    """

    def __init__(self, drafter: EagleDrafter, ctx: DraftContext):
        self.d = drafter
        self.net = drafter.net
        self.ctx = ctx
        s = ctx.settings
        self.sampling = s.temperature > 0 and s.tree == "chain"
        self.top_k = 1 if s.tree == "chain" else s.top_k
        W = self.net.config.window
        n = drafter.rows.shape[0]
        raw_k, self.ctx_v = (t[None] for t in drafter.rows_kv)
        self.ctx_k = rope(raw_k, torch.arange(W - n, W, device=drafter.rows.device))
        self.k: list[torch.Tensor] = []     # per processed node [H, Dh]
        self.v: list[torch.Tensor] = []
        self.hid: list[torch.Tensor] = []   # norm(o) of each processed node
        self.anc: list[set[int]] = []       # processed ancestors (self excluded)
        self.q: list[torch.Tensor] = []     # sampled proposal rows

    @torch.no_grad()
    def expand(self, nodes: list[tree_build.Node]) -> list[list]:
        net, parts, d = self.net, self.d.parts, self.d
        dev = d.rows.device
        W = net.config.window
        tokens = torch.tensor([n.token for n in nodes], device=dev)
        if nodes[0].depth == 0:
            parents = [-1]
            hidden = d.h_last[None]
        else:
            parents = [n.payload[0] for n in nodes]
            hidden = torch.stack([self.hid[p] for p in parents])
        rows = net.rows(parts, tokens, hidden)[None]                    # [1, F, D]
        pos = torch.tensor([W + n.depth for n in nodes], device=dev)
        k, v = net.kv(rows, pos)
        P, Fn, n_ctx = len(self.k), len(nodes), self.ctx_k.shape[1]
        anc = [set() if p < 0 else self.anc[p] | {p} for p in parents]
        see_nodes = torch.zeros(Fn, P, dtype=torch.bool, device=dev)
        for f, a in enumerate(anc):
            if a:
                see_nodes[f, list(a)] = True
        mask = torch.cat([torch.ones(Fn, n_ctx, dtype=torch.bool, device=dev), see_nodes,
                          torch.eye(Fn, dtype=torch.bool, device=dev)], dim=1)
        keys = [self.ctx_k] + ([torch.stack(self.k)[None]] if P else []) + [k]
        vals = [self.ctx_v] + ([torch.stack(self.v)[None]] if P else []) + [v]
        o = net.attend(rows, pos, torch.cat(keys, 1), torch.cat(vals, 1), mask[None, None])[0]
        logits = parts.logits(o).float()
        for f in range(Fn):
            self.k.append(k[0, f])
            self.v.append(v[0, f])
            self.anc.append(anc[f])
        self.hid.extend(parts.norm(o))
        slots = list(range(P, P + Fn))
        s = self.ctx.settings
        if self.sampling:
            probs = torch.softmax(logits / s.temperature, dim=-1)
            picks = torch.multinomial(probs.cpu(), 1, generator=self.ctx.generator)[:, 0].tolist()
            out = []
            for f, tok in enumerate(picks):
                self.q.append(probs[f])
                lp = float(probs[f, tok].clamp_min(1e-30).log())
                out.append([(tok, lp, (slots[f], len(self.q) - 1))])
            return out
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
        vals, ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
        return [[(ids[f][j], vals[f][j], (slots[f], None)) for j in range(len(ids[f]))]
                for f in range(Fn)]
