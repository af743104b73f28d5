"""Plain-torch references for the gated delta rule on chains and trees.

These are the ground truth for the Triton kernels beside them and the CPU path of the
runtime. Shapes (fla's conventions, state key-first):

    q, k   [B, N, H, K]   q already l2-normalised and scaled by K**-0.5, k l2-normalised
    v      [B, N, H, V]
    g      [B, N, H]      log decay (< 0)
    beta   [B, N, H]      write strength
    S0     [B, H, K, V]   fp32 state before the first node
    parents [N]           parent node index, -1 for a node hanging off S0; parents[i] < i

Every verify function returns (o, delta): o [B, N, H, V] the outputs, and delta
[B, N, H, V] the residual written by each node. (k, delta, g) are the per-token *factors*:
the state at the end of any root-to-node path is

    S = exp(G) S0 + sum_{t on path} exp(G - G_t) k_t delta_t^T,

which `commit_ref` rebuilds one rank-1 update at a time, in the order AR decoding uses.
No verify function writes S0.
"""
from __future__ import annotations

import dataclasses

import torch


def gated_delta_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for every batch row and head.

    S [B,H,K,V]; k [B,H,K]; v [B,H,V]; g, beta [B,H]. Returns (new S, delta [B,H,V]).
    AR decoding, the serial verifiers and the commit all go through this function, so the
    committed state and the AR state are computed by the same floating-point operations.
    """
    S = S * g.exp()[..., None, None]
    delta = beta[..., None] * (v - (S * k[..., None]).sum(-2))
    S = S + k[..., :, None] * delta[..., None, :]
    return S, delta


def chain_verify_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, S0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial walk over a chain (node i's parent is i-1), the state kept local."""
    S = S0.float()
    o, delta = torch.empty_like(v, dtype=torch.float32), torch.empty_like(v, dtype=torch.float32)
    for t in range(q.shape[1]):
        S, delta[:, t] = gated_delta_step(S, k[:, t].float(), v[:, t].float(), g[:, t].float(),
                                          beta[:, t].float())
        o[:, t] = (S * q[:, t].float()[..., None]).sum(-2)
    return o, delta


def is_chain(parents: torch.Tensor) -> bool:
    return bool((parents == torch.arange(-1, parents.numel() - 1, device=parents.device)).all())


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool, mask[i, j] = j is a proper ancestor of i."""
    n = parents.numel()
    if is_chain(parents):   # long chains (prefill, training): no per-node loop
        return torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    mask = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] = mask[p]
            mask[i, p] = True
    return mask


def path_log_decay(g: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """G_i = g_i + G_parent(i): cumulative log decay along each root-to-node path."""
    if is_chain(parents):
        return g.float().cumsum(1)
    G = torch.empty_like(g, dtype=torch.float32)
    for i, p in enumerate(parents.tolist()):
        G[:, i] = g[:, i].float() + (G[:, p] if p >= 0 else 0.0)
    return G


class TreeMasks:
    """What the parallel form needs of a topology, built once and shared by every layer.

    anc [N, N] float (1 where j is a proper ancestor of i); path [N, N] float (ancestor or
    self: G = path @ g sums each node's path decay); outside [N, N] bool (not on i's path);
    eye [N, N] float.
    """

    def __init__(self, parents: torch.Tensor):
        n = parents.numel()
        anc = ancestor_mask(parents)
        eye = torch.eye(n, dtype=torch.bool, device=anc.device)
        self.chain = is_chain(parents)
        self.anc = anc.float()
        self.path = (anc | eye).float()
        self.outside = ~(anc | eye)
        self.eye = eye.float()


def tree_verify_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, S0: torch.Tensor, parents: torch.Tensor,
                    masks: TreeMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-masked parallel form (the UT transform restricted to ancestors).

        A_ij = beta_i exp(G_i - G_j) (k_i . k_j)      j a proper ancestor of i, else 0
        U    = (I + A)^-1 (beta * (V - exp(G) * (K S0)))       rows of U are the deltas
        O_i  = exp(G_i) q_i^T S0 + sum_{j in anc(i) + i} exp(G_i - G_j) (q_i . k_j) u_j

    Entries between different branches are exactly zero, so each path sees only its own
    ancestors, and no per-node state is ever formed. `masks` (from `TreeMasks(parents)`)
    may be passed in so that a multi-layer forward builds them once.
    """
    m = masks if masks is not None else TreeMasks(parents)
    q, k, v, beta, S0 = q.float(), k.float(), v.float(), beta.float(), S0.float()
    # path decay: a cumsum on chains; on trees one matmul with the path mask (no node loop)
    G = (g.float().cumsum(1) if m.chain else m.path @ g.float()).transpose(1, 2)   # [B, H, N]
    decay = (G[..., :, None] - G[..., None, :]).masked_fill_(m.outside, float("-inf")).exp_()
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))               # [B, H, N, *]
    bh = beta.transpose(1, 2)[..., None]                              # [B, H, N, 1]
    A = bh * decay * (kh @ kh.transpose(-1, -2)) * m.anc              # strictly lower
    eG = G.exp()[..., None]
    rhs = bh * (vh - eG * (kh @ S0))
    u = torch.linalg.solve_triangular(m.eye + A, rhs, upper=False, unitriangular=True)
    o = eG * (qh @ S0) + (decay * (qh @ kh.transpose(-1, -2))) @ u
    return o.transpose(1, 2), u.transpose(1, 2)


def heavy_light_chains(parents: list[int]) -> list[list[int]]:
    """Split a tree into chains by heavy-light decomposition.

    Each node continues the chain of its parent when it is the parent's heavy child (the
    child with the largest subtree, first one on ties); other children start new chains.
    Chains come out in dependency order: a chain's head hangs off a chain listed earlier.
    """
    n = len(parents)
    size = [1] * n
    for i in range(n - 1, -1, -1):
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    heavy: dict[int, int] = {}
    for i in range(n):
        p = parents[i]
        if p >= 0 and (p not in heavy or size[i] > size[heavy[p]]):
            heavy[p] = i
    chains: list[list[int]] = []
    for i in range(n):
        if parents[i] < 0 or heavy[parents[i]] != i:      # i starts a chain
            chain = [i]
            while chain[-1] in heavy:
                chain.append(heavy[chain[-1]])
            chains.append(chain)
    chains.sort(key=lambda c: c[0])                      # heads in topological order
    return chains


def hybrid_verify_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, S0: torch.Tensor,
                      parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk each heavy-light chain serially; keep a state only where a light edge leaves."""
    plist = parents.tolist()
    branch_points = {p for i, p in enumerate(plist) if p >= 0}
    boundary: dict[int, torch.Tensor] = {}
    o = torch.empty_like(v, dtype=torch.float32)
    delta = torch.empty_like(v, dtype=torch.float32)
    for chain in heavy_light_chains(plist):
        head_parent = plist[chain[0]]
        S = S0.float() if head_parent < 0 else boundary[head_parent]
        for t in chain:
            S, delta[:, t] = gated_delta_step(S, k[:, t].float(), v[:, t].float(),
                                              g[:, t].float(), beta[:, t].float())
            o[:, t] = (S * q[:, t].float()[..., None]).sum(-2)
            if t in branch_points:
                boundary[t] = S
    return o, delta


def commit_ref(S0: torch.Tensor, k: torch.Tensor, delta: torch.Tensor,
               g: torch.Tensor) -> torch.Tensor:
    """Rebuild the state after the path whose factors are given, one token at a time.

    k [B, T, H, K], delta [B, T, H, V], g [B, T, H] in path order. Same operations as
    `gated_delta_step`, so the result matches AR decoding to the last bit of the
    recurrence itself.
    """
    S = S0.float()
    for t in range(k.shape[1]):
        S = S * g[:, t].float().exp()[..., None, None]
        S = S + k[:, t].float()[..., :, None] * delta[:, t].float()[..., None, :]
    return S


def commit_closed_form(S0: torch.Tensor, k: torch.Tensor, delta: torch.Tensor,
                       g: torch.Tensor) -> torch.Tensor:
    """`commit_ref` in one shot: S = exp(G_T) S0 + sum_t exp(G_T - G_t) k_t delta_t^T.

    Same result up to fp32 rounding, in a fixed handful of ops instead of ~8 per token: what
    the CPU folds a multi-token accepted path with (a one-token fold keeps `commit_ref`).
    """
    G = g.float().cumsum(1)                                           # [B, T, H]
    weight = (G[:, -1:] - G).exp()                                    # exp(G_T - G_t)
    kw = (k.float() * weight[..., None]).permute(0, 2, 3, 1)          # [B, H, K, T]
    return S0.float() * G[:, -1].exp()[..., None, None] + kw @ delta.float().transpose(1, 2)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's kernels: x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def tree_conv_index(parents: list[int], width: int) -> torch.Tensor:
    """[N, width] gather index of every node's short conv in concat(committed window
    [width-1], node inputs [N]): a node's taps are its ancestors on its own path (nearest
    last, itself last of all), then the committed window; never its neighbours in node order."""
    hist = width - 1
    rows = []
    for i in range(len(parents)):
        taps, node, back = [], i, hist - 1
        for _ in range(width):
            if node >= 0:
                taps.append(hist + node)
                node = parents[node]
            else:
                taps.append(back)
                back -= 1
        rows.append(taps[::-1])
    return torch.tensor(rows, dtype=torch.long)


def tree_conv_ref(x: torch.Tensor, window: torch.Tensor, index: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal short conv of every draft node along its own ancestor path, then SiLU.

    x [1, N, C] the nodes' conv inputs; window [1, C, W-1] the committed inputs (oldest
    first); index [N, W] positions in concat(window, x) (a node's ancestors, then itself);
    weight [C, W]. fp32 accumulation and one rounding to x.dtype, as fla's conv update
    kernel does for one AR token.
    """
    history = torch.cat([window.transpose(1, 2).to(x.dtype), x], dim=1)
    out = (history[:, index].float() * weight.t().float()).sum(2)
    if bias is not None:
        out = out + bias.float()
    return torch.nn.functional.silu(out).to(x.dtype)


def conv_gates_ref(x: torch.Tensor, window: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor,
                   dt_bias: torch.Tensor, head_dim: int, head_v_dim: int, neg_eigval: bool = False):
    """Everything between a layer's input projection and its recurrence, for N draft nodes.

    x [1, N, C] holds q | k | v conv inputs (C = 2 H K + H V); a, b [1, N, H] the raw gate
    and beta projections. Returns the recurrence inputs q, k [1,N,H,K] (l2-normalised, q
    scaled by K^-1/2), v [1,N,H,V], g (log decay), beta [1,N,H], all fp32.
    """
    H = a.shape[-1]
    y = tree_conv_ref(x, window, index, weight, bias)
    q, k, v = y.float().split([H * head_dim, H * head_dim, H * head_v_dim], dim=-1)
    q = l2norm(q.unflatten(-1, (H, head_dim))) * head_dim ** -0.5
    k = l2norm(k.unflatten(-1, (H, head_dim)))
    g = neg_A * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = b.float().sigmoid() * (2 if neg_eigval else 1)
    return q, k, v.unflatten(-1, (H, head_v_dim)), g, beta


def conv_recurrent_step_ref(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor,
                            S: torch.Tensor, head_dim: int, head_v_dim: int, neg_eigval: bool = False):
    """One AR token from the input projection's conv inputs to the recurrence output.

    x [1, 1, C]; cache [1, C, W] the last W conv inputs, newest last (its oldest is no longer
    needed); a, b [1, 1, H]; S [1, H, K, V] fp32. Returns (o [1, 1, H, V] fp32, the new state,
    the new cache: the conv inputs shifted by one with x newest).
    """
    W = cache.shape[-1]
    index = torch.arange(W, device=x.device).view(1, W)
    q, k, v, g, beta = conv_gates_ref(x, cache[..., 1:], index, weight, bias, a, b, neg_A, dt_bias,
                                      head_dim, head_v_dim, neg_eigval)
    S, _ = gated_delta_step(S.float(), k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    o = (S * q[:, 0][..., None]).sum(-2)
    new_cache = torch.cat([cache[..., 1:], x.transpose(1, 2).to(cache.dtype)], dim=-1)
    return o[:, None], S, new_cache


def recurrent_step_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       neg_A: torch.Tensor, dt_bias: torch.Tensor, S: torch.Tensor,
                       neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One AR token of the recurrence from the conv outputs q, k [1,1,H,K], v [1,1,H,V] and
    the raw gate projections a, b [1,1,H]: (o [1,1,H,V] in v's dtype, the new fp32 state)."""
    K = q.shape[-1]
    qn = l2norm(q.float()) * K ** -0.5
    g = neg_A * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = b.float().sigmoid() * (2 if neg_eigval else 1)
    S, _ = gated_delta_step(S.float(), l2norm(k.float())[:, 0], v.float()[:, 0], g[:, 0], beta[:, 0])
    return (S * qn[:, 0][..., None]).sum(-2)[:, None].to(v.dtype), S


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the model's arithmetic: the add rounds to x's
    dtype, the norm runs in fp32 and rounds once."""
    if residual is not None:
        x = residual + x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype), x


def gated_norm_ref(o: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   activation: str) -> torch.Tensor:
    """The attention output's norm over each head's last dimension, times act(gate)."""
    dtype = weight.dtype if gate is None else gate.dtype
    y, _ = rms_norm_ref(o.to(dtype), weight, eps)
    if gate is None:
        return y
    return y * (torch.nn.functional.silu(gate) if activation in ("swish", "silu") else gate.sigmoid())


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def norm_linear_ref(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ w.T, x + residual): `triton_projection.norm_linear`."""
    h, summed = rms_norm_ref(x, norm_w, eps, residual)
    return torch.nn.functional.linear(h, w), summed


def norm_linear_conv_ref(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                         w: torch.Tensor, cache: torch.Tensor, conv_w: torch.Tensor,
                         conv_b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x + residual, the new cache) for one token x [1, 1, K]: y = `norm_linear_ref`'s
    output with its first C columns (conv_w [C, W]) replaced by their conv step against
    cache [1, C, W] (the last W inputs, newest last), which shifts by one with them newest:
    `triton_projection.norm_linear_conv`."""
    y, summed = norm_linear_ref(x, norm_w, eps, residual, w)
    C, W = conv_w.shape
    index = torch.arange(W, device=x.device).view(1, W)
    conv = tree_conv_ref(y[..., :C], cache[..., 1:], index, conv_w, conv_b)
    new_cache = torch.cat([cache[..., 1:], y[..., :C].transpose(1, 2).to(cache.dtype)], dim=-1)
    return torch.cat([conv, y[..., C:]], dim=-1), summed, new_cache


def gated_norm_linear_ref(o: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float,
                          activation: str, w: torch.Tensor) -> torch.Tensor:
    """o [..., H, V] normed per head times act(gate [..., H*V]), projected by w [N, H*V]."""
    y = gated_norm_ref(o, gate.unflatten(-1, o.shape[-2:]), norm_w, eps, activation)
    return torch.nn.functional.linear(y.flatten(-2), w)


def swiglu_linear_ref(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:], projected by w [N, I]."""
    I = w.shape[1]
    return torch.nn.functional.linear(swiglu_ref(gate_up[..., :I], gate_up[..., I:]), w)


def greedy_take_ref(logits: torch.Tensor, next_token: torch.Tensor, out: torch.Tensor,
                    count: torch.Tensor) -> None:
    """argmax(logits [1, vocab]) (the first index of the maximum) -> next_token [1, 1],
    out[min(count, len(out) - 1)]; count += 1, all in place and without a host sync."""
    nxt = logits.argmax(-1, keepdim=True)
    next_token.copy_(nxt)
    out.index_copy_(0, count.clamp(max=out.numel() - 1), nxt.view(1))
    count.add_(1)


@dataclasses.dataclass
class DecodeWeights:
    """A GDN model's weights stacked over layers ([L, ...], contiguous) for a whole decode
    step: w_in rows are q | k | v (the conv inputs, C = 2HK + HV), the output gate (HV),
    a, b (H each)."""
    embed: torch.Tensor        # [vocab, D]
    attn_norm: torch.Tensor    # [L, D]
    w_in: torch.Tensor         # [L, C + H*V + 2H, D]
    conv_w: torch.Tensor       # [L, C, W]
    conv_b: torch.Tensor | None
    neg_A: torch.Tensor        # fp32 [L, H]: -exp(A_log)
    dt_bias: torch.Tensor      # fp32 [L, H]
    o_norm: torch.Tensor       # [L, V]
    w_o: torch.Tensor          # [L, D, H*V]
    mlp_norm: torch.Tensor     # [L, D]
    w_gate_up: torch.Tensor    # [L, 2I, D]
    w_down: torch.Tensor       # [L, D, I]
    final_norm: torch.Tensor   # [D]
    lm_head: torch.Tensor      # [vocab, D]


def decode_step_ref(token: int, wt: DecodeWeights, cache: torch.Tensor, S: torch.Tensor, eps: float,
                    head_dim: int, head_v_dim: int, swish: bool = True, neg_eigval: bool = False):
    """One AR token through the whole model, composed of the per-op references.

    cache [L, 1, C, W] (the conv inputs, newest last), S [L, 1, H, K, V] fp32. Returns (fp32
    logits [vocab], the new S, the new cache); the inputs are not written.
    """
    H, V = wt.neg_A.shape[1], head_v_dim
    C = cache.shape[2]
    x, residual = wt.embed[token].view(1, 1, -1), None
    S, cache = S.clone(), cache.clone()
    for l in range(wt.w_in.shape[0]):
        y, residual = norm_linear_ref(x, wt.attn_norm[l], eps, residual, wt.w_in[l])
        conv_in, gate, a, b = y.split([C, H * V, H, H], dim=-1)
        bias = None if wt.conv_b is None else wt.conv_b[l]
        o, S[l], cache[l] = conv_recurrent_step_ref(conv_in, cache[l], wt.conv_w[l], bias, a, b, wt.neg_A[l],
                                                    wt.dt_bias[l], S[l], head_dim, V, neg_eigval)
        x = gated_norm_linear_ref(o, gate, wt.o_norm[l], eps, "swish" if swish else "sigmoid", wt.w_o[l])
        gate_up, residual = norm_linear_ref(x, wt.mlp_norm[l], eps, residual, wt.w_gate_up[l])
        x = swiglu_linear_ref(gate_up, wt.w_down[l])
    h, _ = rms_norm_ref(x, wt.final_norm, eps, residual)
    return torch.nn.functional.linear(h.float(), wt.lm_head.float()).view(-1), S, cache


def chain_verify_step_ref(tokens: list[int], wt: DecodeWeights, cache: torch.Tensor, S: torch.Tensor, eps: float,
                          head_dim: int, head_v_dim: int, pending=None, feature_layers: tuple[int, ...] = (),
                          swish: bool = True, neg_eigval: bool = False,
                          parents: list[int] | None = None) -> dict[str, torch.Tensor | None]:
    """A draft chain's verification forward through the whole model, composed of the per-op
    references: tokens[0] is the root and each token the next one's parent; or, given
    `parents` (-1 for the root, topological order), a draft tree's.

    cache [L, 1, C, W] (the committed conv inputs, newest last) and S [L, 1, H, K, V] fp32
    are read, not written; `pending` (k [L,1,P,H,K], delta [L,1,P,H,V], g [L,1,P,H]) is the
    deferred commit, folded into S first. Returns logits [N, vocab] fp32, hidden [N, D] (the
    final norm's rows), features [N, F, D] (the outputs of `feature_layers`, or None), S (the
    state with the pending commit folded) and each layer's factors k [L,1,N,H,K],
    g [L,1,N,H], delta [L,1,N,H,V] fp32 and conv_in [L,1,N,C] (the raw conv inputs).
    """
    H, V = wt.neg_A.shape[1], head_v_dim
    L, C, W = cache.shape[0], cache.shape[2], cache.shape[3]
    N = len(tokens)
    index = torch.arange(N)[:, None] + torch.arange(W)[None, :] if parents is None else tree_conv_index(parents, W)
    x, residual = wt.embed[torch.tensor(tokens)].unsqueeze(0), None
    S = S.float().clone()
    factors: dict[str, list[torch.Tensor]] = {"k": [], "g": [], "delta": [], "conv_in": []}
    feats = []
    for l in range(L):
        y, residual = norm_linear_ref(x, wt.attn_norm[l], eps, residual, wt.w_in[l])
        if l > 0 and l - 1 in feature_layers:
            feats.append(residual[0])
        conv_in, gate, a, b = y.split([C, H * V, H, H], dim=-1)
        bias = None if wt.conv_b is None else wt.conv_b[l]
        q, k, v, g, beta = conv_gates_ref(conv_in, cache[l][..., 1:], index, wt.conv_w[l], bias, a, b, wt.neg_A[l],
                                          wt.dt_bias[l], head_dim, V, neg_eigval)
        if pending is not None:
            S[l] = commit_ref(S[l], pending[0][l], pending[1][l], pending[2][l])
        if parents is None:
            o, delta = chain_verify_ref(q, k, v, g, beta, S[l])
        else:
            o, delta = tree_verify_ref(q, k, v, g, beta, S[l], torch.tensor(parents))
        for name, value in (("k", k), ("g", g), ("delta", delta), ("conv_in", conv_in)):
            factors[name].append(value)
        x = gated_norm_linear_ref(o, gate, wt.o_norm[l], eps, "swish" if swish else "sigmoid", wt.w_o[l])
        gate_up, residual = norm_linear_ref(x, wt.mlp_norm[l], eps, residual, wt.w_gate_up[l])
        x = swiglu_linear_ref(gate_up, wt.w_down[l])
    h, residual = rms_norm_ref(x, wt.final_norm, eps, residual)
    if L - 1 in feature_layers:
        feats.append(residual[0])
    logits = torch.nn.functional.linear(h.float(), wt.lm_head.float())[0]
    return dict(logits=logits, hidden=h[0], features=torch.stack(feats, dim=1) if feats else None, S=S,
                **{name: torch.stack(values) for name, values in factors.items()})


VERIFY_REFERENCES = {
    "tree": tree_verify_ref,
    "hybrid": hybrid_verify_ref,
}


def ngram_chain_ref(history: list[int], new_tokens: list[int], capacity: int, max_ngram: int, min_ngram: int,
                    nodes: int) -> tuple[list[int], list[int]]:
    """Prompt lookup, one chain: append `new_tokens` to `history` (the most recent `capacity`
    kept), then find the latest earlier position whose last n tokens (min_ngram <= n <= max_ngram,
    as many as match, the longest first) equal the history's last n, and draft the `nodes`
    tokens that followed it (-1 past the history's end, or everywhere without a match).
    Returns (the new history, the chain)."""
    history = (list(history) + list(new_tokens))[-capacity:]
    last = len(history) - 1
    best = None                 # (match length, position): longer first, then more recent
    for p in range(last):
        n = 0
        while n < max_ngram and p - n >= 0 and history[p - n] == history[last - n]:
            n += 1
        if n >= min_ngram and (best is None or (n, p) > best):
            best = (n, p)
    if best is None:
        return history, [-1] * nodes
    follow = history[best[1] + 1:best[1] + 1 + nodes]
    return history, follow + [-1] * (nodes - len(follow))
