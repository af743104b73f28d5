"""Triton kernels that verify draft chains and trees against a Gated DeltaNet state.

Each kernel computes what a plain-torch reference in `kernels/reference.py` computes:

    verify("chain")   `_walk_kernel` (SCHEDULED=False)             chain_verify_ref
    verify("hybrid")  `_walk_kernel` (SCHEDULED=True), per wave     hybrid_verify_ref
    verify("tree")    `_parallel_kernel` (N <= PARALLEL_MAX_NODES)  tree_verify_ref
                      else `_tree_gram_kernel` + `_tree_solve_kernel`
    commit()          `_commit_kernel`                              commit_ref

Shapes as in the references: q, k [B,N,H,K]; v [B,N,H,V]; g, beta [B,N,H]; S0 [B,H,K,V]
fp32, key-first. All math is fp32 (inputs of other dtypes are upcast on load). The verify
kernels return (o, delta) [B,N,H,V] fp32 and never write S0, except to fold a `pending`
deferred commit (k_p [B,P,H,K], delta_p [B,P,H,V], g_p [B,P,H]) into it first.

Why tiles over V: the recurrence is independent per value column (delta_t[:, c] depends
only on column c of the state), so a program can own a [K, BV] slice of one head's state
in registers (a whole GDN-1.3B head is 256 KiB fp32, more than an SM's shared memory)
and walk every token, and one head spreads over many SMs.

After a topology's first call (or `prepare_topology`) the per-call path does no host
work that waits on the device (no .item(), .tolist(), .cpu()), so it can be captured in a
CUDA graph. Tree mode reads the parents from `topo.parents` on the device, so even a graph
captured for one tree size can replay with other trees of that size written into the same
tensor; the hybrid's launch grid depends on the tree's shape, so its schedule is built on
the host once per topology and kept in `topo.cache`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.l2_prefetch import l2_prefetch_applies, l2_prefetch_lines
from kernels.reference import heavy_light_chains

MODES = ("chain", "tree", "hybrid")
MAX_TREE_NODES = 128        # the tree kernels hold [N, N] matrices in registers
# Up to this many nodes the parallel form is one launch: every (head, V tile) program
# builds the [N, N] Gram matrices itself (redundant across V tiles, but N^2 K FMAs cost
# less than a second launch) and inverts I + A by repeated squaring, whose rounding grows
# with N (`_parallel_kernel`); past 16 a refinement step no longer repairs it.
PARALLEL_MAX_NODES = 16
# Chains of CHAIN_PARALLEL_MIN_NODES..PARALLEL_MAX_NODES nodes take the parallel form, the
# others the walk: with a deferred commit of 8 the walk is faster at 4 nodes (9.3 against
# 12.9 us a layer at the GDN-1.3B shape, 5.5 against 5.2-7.7 at the embedded), the parallel
# form from 9 (12.9 against 14.9; 5.2 against 9.0). H200, benchmarks/results/h200/session12/.
CHAIN_PARALLEL_MIN_NODES = 6
FORMS = {"chain": ("walk", "parallel"), "tree": ("parallel", "gram_solve"), "hybrid": ("walk",)}
MAX_K, MAX_V = 256, 512     # a [K, BV] state tile lives in registers; V is tiled
# fp32 products of the tree kernels. Triton's default for an fp32 tl.dot on a GPU is tf32
# (~1e-3 relative error, too coarse to match the serial recurrence); "ieee" is plain fp32
# FMA ("tf32x3" is near-fp32 on tensor cores but used more registers in ptxas reports).
DOT_PRECISION = "ieee"
# o may be written rounded to the model's dtype (what the output norm reads); delta is fp32
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The walk kernels' tile orientation: [BV, K] (sums over K within a warp) or [K, BV]
WALK_V_FIRST = False
# Whether the parallel form builds (I + A)^-1 from the keys before it reads the state
# (`_parallel_tile`'s GRAM_FIRST) rather than in the same pass, and its products' precision
# ("tf32x3": three tf32 passes on tensor cores, near fp32)
PARALLEL_GRAM_FIRST = False
PARALLEL_DOT_PRECISION = DOT_PRECISION


# ---------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------

@triton.jit
def _fold_pending(h, kp, dp, gp, i_b, i_h, P, o_k, o_v,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr = False,
                  PB: tl.constexpr = 16):
    """Apply P accepted rank-1 updates to a state tile h, `commit_closed_form` PB at a time.

    h is [BK, BV] ([BV, BK] with V_FIRST); o_k and o_v (1-D) index its key rows and value
    columns. Within a block of PB factors, S = exp(G_T) S + sum_t exp(G_T - G_t) k_t d_t^T as
    one product: a serial fold waits on three dependent loads per factor, this on one block.
    Blocks fold in order. Rows of the state are independent here, so a tile may cover any
    subset of K.
    """
    o_p = tl.arange(0, PB)
    for p0 in range(0, P, PB):
        m = p0 + o_p < P
        row = (i_b * P + p0 + o_p) * H + i_h                                      # [PB]
        b_g = tl.load(gp + row, mask=m, other=0.).to(tl.float32)
        G = tl.cumsum(b_g, 0)
        G_T = tl.sum(b_g, 0)
        b_k = tl.load(kp + row[:, None] * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
        b_k = b_k * tl.exp(G_T - G)[:, None]                                      # [PB, BK]
        b_d = tl.load(dp + row[:, None] * V + o_v[None, :], mask=m[:, None], other=0.).to(tl.float32)
        if V_FIRST:
            h = h * tl.exp(G_T) + tl.dot(tl.trans(b_d), b_k, input_precision="ieee")
        else:
            h = h * tl.exp(G_T) + tl.dot(tl.trans(b_k), b_d, input_precision="ieee")
    return h


@triton.jit
def _load_token(q, k, v, g, beta, row, o_k, o_v, mask, K: tl.constexpr, V: tl.constexpr):
    """One token's q, k [K, 1], v [1, BV] and g, beta scalars, as fp32 (zeros if masked)."""
    b_q = tl.load(q + row * K + o_k, mask=mask, other=0.).to(tl.float32)
    b_k = tl.load(k + row * K + o_k, mask=mask, other=0.).to(tl.float32)
    b_v = tl.load(v + row * V + o_v, mask=mask, other=0.).to(tl.float32)
    b_g = tl.load(g + row, mask=mask, other=0.).to(tl.float32)
    b_beta = tl.load(beta + row, mask=mask, other=0.).to(tl.float32)
    return b_q, b_k, b_v, b_g, b_beta


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _check_inputs(q, k, v, g, beta, S0, pending) -> tuple[int, int, int, int, int, int]:
    """Shapes, dtypes and devices (host metadata only, no device sync). Returns B,N,H,K,V,P."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, N, H, K], got shape {tuple(q.shape)}")
    B, N, H, K = q.shape
    V = v.shape[-1]
    expected = {"k": (k, (B, N, H, K)), "v": (v, (B, N, H, V)), "g": (g, (B, N, H)),
                "beta": (beta, (B, N, H)), "S0": (S0, (B, H, K, V))}
    P = 0
    if pending is not None:
        if len(pending) != 3:
            raise ValueError("pending must be a tuple (k_p [B,P,H,K], delta_p [B,P,H,V], g_p [B,P,H])")
        P = pending[0].shape[1] if pending[0].dim() == 4 else -1
        expected.update({"pending k": (pending[0], (B, P, H, K)),
                         "pending delta": (pending[1], (B, P, H, V)),
                         "pending g": (pending[2], (B, P, H))})
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape} "
                             f"(from q [B, N, H, K] = {tuple(q.shape)})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not _is_pow2(K) or not 16 <= K <= MAX_K:
        raise ValueError(f"key head dim K={K} must be a power of two in [16, {MAX_K}]")
    if not _is_pow2(V) or not 16 <= V <= MAX_V:
        raise ValueError(f"value head dim V={V} must be a power of two in [16, {MAX_V}]")
    if S0.dtype != torch.float32:
        raise ValueError(f"the state S0 must be float32, got {S0.dtype}")
    if N == 0:
        raise ValueError("nothing to verify: N = 0 nodes")
    return B, N, H, K, V, P


def supports(K: int, V: int) -> bool:
    """Whether the verify and commit kernels take key / value head dims K and V."""
    return _is_pow2(K) and 16 <= K <= MAX_K and _is_pow2(V) and 16 <= V <= MAX_V


def _contig(*ts):
    return [t.contiguous() for t in ts]


def _walk_config(rows: int, K: int, V: int, block_v: int | None = None,
                 num_warps: int | None = None) -> tuple[int, int]:
    """Tile width and warps for the serial walk kernels (chain, hybrid, commit, baselines).

    A walk is latency-bound at batch 1 (every token waits on the previous one), so prefer
    narrow tiles that spread one head over many SMs: the widest BV that still gives ~128
    programs (an H200 has 132 SMs), and ~32 state floats per thread.
    """
    if block_v is None:
        block_v = 16
        for bv in (64, 32):   # K * BV <= 8192: a 256 x 64 tile spills (ptxas, sm_90)
            if bv <= V and K * bv <= 8192 and rows * (V // bv) >= 128:
                block_v = bv
                break
    block_v = min(block_v, V)
    if num_warps is None:
        num_warps = max(1, min(8, K * block_v // 1024))
    return block_v, num_warps


# ---------------------------------------------------------------------------------------
# Chain and hybrid: the state-resident serial walk
#   reference: chain_verify_ref, hybrid_verify_ref
# ---------------------------------------------------------------------------------------

# Sizes are not specialised on (Triton would otherwise compile separate variants for
# N == 1 and N % 16 == 0): one compiled kernel serves every draft size.
@triton.jit(do_not_specialize=["P", "chain_start", "max_len", "N"])
def _walk_kernel(
    q, k, v, g, beta, S, o, delta,
    stride_sb, stride_sh, stride_sk, stride_sv,
    kp, dp, gp, P,                                        # pending factors (HAS_PENDING)
    chain_nodes, chain_len, chain_src, node_slot, scratch, chain_start, max_len,  # SCHEDULED
    N, B: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    SCHEDULED: tl.constexpr, HAS_PENDING: tl.constexpr, V_FIRST: tl.constexpr = False,
):
    """One program = one (batch, head, V tile) of one chain; walks the chain's tokens.

    Chain mode (SCHEDULED=False): the chain is nodes 0..N-1 and starts from S.
    Hybrid (SCHEDULED=True): program_id(2) picks a chain of this wave from the schedule;
    it starts from S (head hangs off the root state) or from a boundary state in
    `scratch`, and writes the state after every node that has a slot (a node with a light
    child) back to `scratch` for the next wave. S itself is written only by the pending
    fold, once, before any token.

    The tile is held [K, BV], or [BV, K] with V_FIRST: then the two sums over K a token
    needs run along a tile row (within a warp, by shuffles) instead of across warps.
    """
    i_v, i_bh, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    # Vectors are kept 2-D in the tile's layout (k/q along K, v/o/delta along BV), so they
    # are loaded straight into it (no layout shuffle per token).
    ks, vs = tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    if V_FIRST:
        o_k, o_v = ks[None, :], vs[:, None]
        RED: tl.constexpr = 1
    else:
        o_k, o_v = ks[:, None], vs[None, :]
        RED: tl.constexpr = 0
    p_S = S + i_b * stride_sb + i_h * stride_sh + o_k * stride_sk + o_v * stride_sv
    # scratch is [slots, B, H, K, V] contiguous; offset of this program's tile in slot 0
    o_tile = (i_b * H + i_h).to(tl.int64) * K * V + o_k * V + o_v

    if SCHEDULED:
        c = chain_start + i_c
        length = tl.load(chain_len + c)
        src = tl.load(chain_src + c)
        if src >= 0:
            h = tl.load(scratch + src.to(tl.int64) * B * H * K * V + o_tile)
        else:
            h = tl.load(p_S)
    else:
        length = N
        h = tl.load(p_S)

    if HAS_PENDING:
        # deferred commit: fold the accepted factors, write the state once, verify from it
        h = _fold_pending(h, kp, dp, gp, i_b, i_h, P, ks, vs, H, K, V, V_FIRST)
        tl.store(p_S, h)

    if SCHEDULED:
        n = tl.load(chain_nodes + c * max_len)
        row = (i_b * N + n) * H + i_h
    else:
        row = i_b * N * H + i_h
    b_q, b_k, b_v, b_g, b_beta = _load_token(q, k, v, g, beta, row, o_k, o_v, length > 0, K, V)
    for t in range(length):
        # Prefetch the next token: its loads do not depend on the state, so they overlap
        # this token's arithmetic instead of stalling the next iteration.
        has_next = t + 1 < length
        if SCHEDULED:
            slot = tl.load(node_slot + n)
            n = tl.load(chain_nodes + c * max_len + t + 1, mask=has_next, other=0)
            row_next = (i_b * N + n) * H + i_h
        else:
            row_next = (i_b * N + t + 1) * H + i_h
        n_q, n_k, n_v, n_g, n_beta = _load_token(q, k, v, g, beta, row_next, o_k, o_v, has_next, K, V)
        # the same steps as gated_delta_step, on this tile's value columns
        h = h * tl.exp(b_g)
        b_d = b_beta * (b_v - tl.sum(h * b_k, RED, keep_dims=True))
        h = h + b_k * b_d
        b_o = tl.sum(h * b_q, RED, keep_dims=True)
        tl.store(o + row * V + o_v, b_o)
        tl.store(delta + row * V + o_v, b_d)
        if SCHEDULED:
            if slot >= 0:
                tl.store(scratch + slot.to(tl.int64) * B * H * K * V + o_tile, h)
        row = row_next
        b_q, b_k, b_v, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta


def _strides(S: torch.Tensor) -> tuple[int, int, int, int]:
    return S.stride(0), S.stride(1), S.stride(2), S.stride(3)


def _pending_args(pending, like: torch.Tensor):
    if pending is None or pending[0].shape[1] == 0:
        return like, like, like, 0, False
    kp, dp, gp = _contig(*pending)
    return kp, dp, gp, kp.shape[1], True


def _chain_verify(q, k, v, g, beta, S0, pending, o, delta, block_v=None, num_warps=None,
                  v_first=None):
    B, N, H, K = q.shape
    V = v.shape[-1]
    BV, warps = _walk_config(B * H, K, V, block_v, num_warps)
    kp, dp, gp, P, has_pending = _pending_args(pending, q)
    _walk_kernel[(V // BV, B * H, 1)](
        q, k, v, g, beta, S0, o, delta, *_strides(S0),
        kp, dp, gp, P,
        q, q, q, q, q, 0, 0,                              # no schedule
        N, B=B, H=H, K=K, V=V, BV=BV, SCHEDULED=False, HAS_PENDING=has_pending,
        V_FIRST=WALK_V_FIRST if v_first is None else v_first, num_warps=warps)


class HybridSchedule:
    """Heavy-light chains of one tree, grouped into dependency waves, as device tensors.

    chain_nodes [C, L] int32: each chain's nodes (padded with -1), chains sorted by wave
    chain_len   [C] int32
    chain_src   [C] int32: boundary slot the chain starts from, -1 = the root state S0
    node_slot   [N] int32: slot a node's state is written to, -1 = none
    waves       host list of (first chain, number of chains): one launch each
    """

    def __init__(self, parents: list[int], device, every_node: bool = False):
        n = len(parents)
        chains = heavy_light_chains(parents)
        chain_of = {node: c for c, chain in enumerate(chains) for node in chain}
        wave = []
        for chain in chains:             # dependency order: a head's parent chain is earlier
            p = parents[chain[0]]
            wave.append(0 if p < 0 else wave[chain_of[p]] + 1)
        # Boundary states: only where a light edge leaves (the parent of a chain head).
        # every_node=True writes every node's state instead: the dense-snapshot baseline.
        if every_node:
            slot_nodes = list(range(n))
        else:
            slot_nodes = sorted({parents[ch[0]] for ch in chains if parents[ch[0]] >= 0})
        node_slot = [-1] * n
        for s, node in enumerate(slot_nodes):
            node_slot[node] = s
        order = sorted(range(len(chains)), key=lambda c: (wave[c], chains[c][0]))
        self.max_len = max(len(c) for c in chains)
        rows = [chains[c] + [-1] * (self.max_len - len(chains[c])) for c in order]
        src = [node_slot[parents[chains[c][0]]] if parents[chains[c][0]] >= 0 else -1 for c in order]
        self.num_slots = len(slot_nodes)
        self.num_chains = len(chains)
        sorted_waves = [wave[c] for c in order]
        self.waves = [(sorted_waves.index(w), sorted_waves.count(w)) for w in sorted(set(wave))]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        self.chain_nodes = as_tensor(rows)
        self.chain_len = as_tensor([len(chains[c]) for c in order])
        self.chain_src = as_tensor(src)
        self.node_slot = as_tensor(node_slot)


def hybrid_schedule(topo, device, every_node: bool = False) -> HybridSchedule:
    """The topology's hybrid schedule, built on the host once and cached in `topo.cache`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:   # "cuda" and "cuda:0": one entry
        device = torch.device("cuda", torch.cuda.current_device())
    # The parents are part of the entry, so a topology whose tree is swapped in place (as
    # a graph's SpecTopology.load does) gets a fresh schedule, never a stale one.
    # A graph captured in hybrid mode stays bound to the schedule it was captured with.
    key = ("triton_hybrid", str(device), every_node)
    parents = tuple(topo.tree.parents)
    entry = topo.cache.get(key)
    if entry is None or entry[0] != parents:
        entry = topo.cache[key] = (parents, HybridSchedule(list(parents), device, every_node))
    return entry[1]


def prepare_topology(topo, device) -> None:
    """Build what the kernels cache per topology now (do this before CUDA-graph capture)."""
    hybrid_schedule(topo, device)


def _hybrid_verify(q, k, v, g, beta, S0, sched: HybridSchedule, pending, o, delta,
                   block_v=None, num_warps=None, scratch=None, v_first=None):
    B, N, H, K = q.shape
    V = v.shape[-1]
    BV, warps = _walk_config(B * H, K, V, block_v, num_warps)
    # The deferred commit rides on the first wave when that wave is one chain (always so for
    # a DraftTree: only node 0 hangs off S0). Several chains reading S0 would race on the
    # write-back, so then fold first with the commit kernel.
    fuse = pending is not None and sched.waves[0][1] == 1
    if pending is not None and not fuse:
        commit(S0, *pending)
    kp, dp, gp, P, has_pending = _pending_args(pending if fuse else None, q)
    if scratch is None:
        scratch = torch.empty((max(sched.num_slots, 1), B, H, K, V), device=q.device,
                              dtype=torch.float32)
    for w, (start, count) in enumerate(sched.waves):
        _walk_kernel[(V // BV, B * H, count)](
            q, k, v, g, beta, S0, o, delta, *_strides(S0),
            kp, dp, gp, P,
            sched.chain_nodes, sched.chain_len, sched.chain_src, sched.node_slot, scratch,
            start, sched.max_len,
            N, B=B, H=H, K=K, V=V, BV=BV, SCHEDULED=True, HAS_PENDING=has_pending and w == 0,
            V_FIRST=WALK_V_FIRST if v_first is None else v_first, num_warps=warps)
    return scratch


# ---------------------------------------------------------------------------------------
# Tree: the tree-masked parallel (UT) form
#   reference: tree_verify_ref
#     A_ij = beta_i exp(G_i - G_j) (k_i . k_j)   j a proper ancestor of i
#     U    = (I + A)^-1 (beta * (V - exp(G) * (K S0)))
#     O_i  = exp(G_i) q_i^T S0 + sum_{j in anc(i) + i} exp(G_i - G_j) (q_i . k_j) u_j
# ---------------------------------------------------------------------------------------

@triton.jit
def _tree_paths(g, parents, o_n, m_n, i_b, i_h, N, H: tl.constexpr, CHAIN: tl.constexpr):
    """Ancestor-or-self mask anc [BN, BN], path log decays G [BN] (G_i = g_i + G_parent(i))
    and decay = exp(G_i - G_j) on anc (0 elsewhere) of one (batch, head).

    A tree is read from the parent pointers on the device: each node climbs to the root
    one parent per iteration (depth iterations), so a graph replays with any tree written
    into `parents`. A chain (CHAIN) is the lower triangle and a cumsum.
    """
    b_g = tl.load(g + (i_b * N + o_n) * H + i_h, mask=m_n, other=0.).to(tl.float32)
    if CHAIN:
        anc = o_n[None, :] <= o_n[:, None]
        G = tl.cumsum(b_g, 0)
    else:
        G = b_g
        anc = o_n[:, None] == o_n[None, :]
        cur = tl.load(parents + o_n, mask=m_n, other=-1).to(tl.int32)
        climbed = 0
        while (tl.max(cur, 0) >= 0) & (climbed < N):          # bounded even for a bad tree
            climbed += 1
            up = cur >= 0
            anc = anc | (cur[:, None] == o_n[None, :])
            G += tl.load(g + (i_b * N + cur) * H + i_h, mask=up, other=0.).to(tl.float32)
            cur = tl.load(parents + cur, mask=up, other=-1).to(tl.int32)
    # exp only where masked in: G_i - G_j between branches can be large and positive
    decay = tl.where(anc, tl.exp(tl.where(anc, G[:, None] - G[None, :], 0.)), 0.)
    return anc, G, decay


@triton.jit(do_not_specialize=["N"])
def _tree_gram_kernel(
    q, k, g, beta, parents, A, Pm, Gout, N,
    H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Per (batch, head): the [BN, BN] matrices A and P = decay * (Q K^T), and G."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    rows = (i_b * N + o_n) * H + i_h

    anc, G, decay = _tree_paths(g, parents, o_n, m_n, i_b, i_h, N, H, False)
    b_beta = tl.load(beta + rows, mask=m_n, other=0.).to(tl.float32)
    o_nn = i_bh.to(tl.int64) * BN * BN + o_n[:, None] * BN + o_n[None, :]

    # Gram matrices over the key dim, one after the other to keep one [BN, BN] accumulator
    # live (fewer registers)
    kk = tl.zeros([BN, BN], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
        kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
    strict = anc & (o_n[:, None] != o_n[None, :])
    tl.store(A + o_nn, tl.where(strict, b_beta[:, None] * decay * kk, 0.))

    qk = tl.zeros([BN, BN], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
        qk += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
    tl.store(Pm + o_nn, decay * qk)
    tl.store(Gout + i_bh * BN + o_n, G)


@triton.jit
def _node_tile(N, H: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, i_v, i_bh):
    """A (head, V tile)'s indices over all BN nodes: batch, head, batch * H + head, node
    offsets and mask, the nodes' rows in [B, N, H, *] tensors, and its value columns."""
    i_b, i_h = i_bh // H, i_bh % H
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    return i_b, i_h, i_bh, o_n, m_n, (i_b * N + o_n) * H + i_h, i_v * BV + tl.arange(0, BV)


@triton.jit(do_not_specialize=["P", "N"])
def _tree_solve_kernel(
    q, k, v, beta, S, o, delta, A, Pm, Gin,
    stride_sb, stride_sh, stride_sk, stride_sv,
    kp, dp, gp, P, N,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Per (batch, head, V tile): right-hand side, forward substitution, outputs.

    The solve is per value column, so V tiles are independent; no per-node state is
    formed. With HAS_PENDING the state tile is folded and written back chunk by chunk
    over K (state rows are independent under a rank-1 update), then used.
    """
    i_b, i_h, i_bh, o_n, m_n, rows, o_v = _node_tile(N, H, BN, BV, tl.program_id(0), tl.program_id(1))

    ks = tl.zeros([BN, BV], dtype=tl.float32)               # K S0
    qs = tl.zeros([BN, BV], dtype=tl.float32)               # Q S0
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_S = S + i_b * stride_sb + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv
        b_S = tl.load(p_S)
        if HAS_PENDING:
            b_S = _fold_pending(b_S, kp, dp, gp, i_b, i_h, P, o_k, o_v, H, K, V)
            tl.store(p_S, b_S)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
        ks += tl.dot(b_k, b_S, input_precision=DOT_PRECISION)
        qs += tl.dot(b_q, b_S, input_precision=DOT_PRECISION)

    G = tl.load(Gin + i_bh * BN + o_n)
    eG = tl.exp(G)
    b_beta = tl.load(beta + rows, mask=m_n, other=0.).to(tl.float32)
    b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
    u = b_beta[:, None] * (b_v - eG[:, None] * ks)

    # (I + A) U = rhs, A strictly lower: u_i = rhs_i - sum_{j<i} A_ij u_j, rows in order.
    # Row i of A is read from memory (written by the gram kernel; the next row is fetched
    # while this one computes) rather than extracted from registers; rows j < i of u are
    # final when row i is computed.
    p_A = A + i_bh.to(tl.int64) * BN * BN
    a_next = tl.load(p_A + BN + o_n, mask=N > 1, other=0.)
    for i in range(1, N):
        a = a_next
        a_next = tl.load(p_A + (i + 1) * BN + o_n, mask=i + 1 < N, other=0.)   # prefetch
        sel = o_n == i
        u_i = tl.sum((tl.where(sel, 1., 0.) - a)[:, None] * u, 0)
        u = tl.where(sel[:, None], u_i[None, :], u)

    o_nn = i_bh.to(tl.int64) * BN * BN + o_n[:, None] * BN + o_n[None, :]
    b_P = tl.load(Pm + o_nn)
    b_o = eG[:, None] * qs + tl.dot(b_P, u, input_precision=DOT_PRECISION)
    m_out = m_n[:, None]
    tl.store(o + rows[:, None] * V + o_v[None, :], b_o, mask=m_out)
    tl.store(delta + rows[:, None] * V + o_v[None, :], u, mask=m_out)


@triton.jit
def _inverse_times(A, A2, A4, A8, x, DOT_PRECISION: tl.constexpr):
    """(I + A)^-1 x for a strictly lower triangular [16, 16] A, given A^2, A^4, A^8."""
    x -= tl.dot(A, x, input_precision=DOT_PRECISION)
    x += tl.dot(A2, x, input_precision=DOT_PRECISION)
    x += tl.dot(A4, x, input_precision=DOT_PRECISION)
    x += tl.dot(A8, x, input_precision=DOT_PRECISION)
    return x


@triton.jit
def _unit_lower_inverse(A, o_n, DOT_PRECISION: tl.constexpr):
    """(I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8) of a strictly lower triangular
    [16, 16] A, as a matrix: four dependent products deep, where applying the factors to a
    vector is seven."""
    A2 = tl.dot(A, A, input_precision=DOT_PRECISION)
    X = tl.where(o_n[:, None] == o_n[None, :], 1., 0.) - A
    X += tl.dot(X, A2, input_precision=DOT_PRECISION)
    A4 = tl.dot(A2, A2, input_precision=DOT_PRECISION)
    X += tl.dot(X, A4, input_precision=DOT_PRECISION)
    A8 = tl.dot(A4, A4, input_precision=DOT_PRECISION)
    return X + tl.dot(X, A8, input_precision=DOT_PRECISION)


@triton.jit
def _qk_block(q, k, rows, m_n, o_k, rq, rk, K: tl.constexpr, SCALED: tl.constexpr):
    """One [BN, BK] block of the nodes' queries and keys, fp32 (SCALED: each row times its scale)."""
    b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
    b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
    if SCALED:
        b_q = b_q * rq[:, None]
        b_k = b_k * rk[:, None]
    return b_q, b_k


@triton.jit
def _qk_scales(q, k, rows, m_n, q_scale, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RAW_QK: tl.constexpr):
    """Per-node row scales of q and k: with RAW_QK the rows are the conv's raw output, which
    the l2 norm (and, for q, `q_scale`) turns into the recurrence's inputs; else ones."""
    rq = tl.full([BN], 1.0, tl.float32)
    rk = tl.full([BN], 1.0, tl.float32)
    if RAW_QK:
        ssq = tl.zeros([BN], dtype=tl.float32)
        ssk = tl.zeros([BN], dtype=tl.float32)
        for i_k in tl.static_range(K // BK):     # unrolled: every block's loads in flight at once
            b_q, b_k = _qk_block(q, k, rows, m_n, i_k * BK + tl.arange(0, BK), rq, rk, K, False)
            ssq += tl.sum(b_q * b_q, axis=1)
            ssk += tl.sum(b_k * b_k, axis=1)
        rq = (1.0 / tl.sqrt(ssq + 1e-6)) * q_scale
        rk = 1.0 / tl.sqrt(ssk + 1e-6)
    return rq, rk


@triton.jit
def _gram(q, k, rows, m_n, rq, rk, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          DOT_PRECISION: tl.constexpr, RAW_QK: tl.constexpr):
    """K K^T and Q K^T [BN, BN] of one head's nodes (rows scaled by rq, rk)."""
    kk = tl.zeros([BN, BN], dtype=tl.float32)
    qk = tl.zeros([BN, BN], dtype=tl.float32)
    for i_k in range(K // BK):
        b_q, b_k = _qk_block(q, k, rows, m_n, i_k * BK + tl.arange(0, BK), rq, rk, K, RAW_QK)
        kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
        qk += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
    return kk, qk


@triton.jit
def _parallel_tile(
    q, k, v, g, beta, parents, S, o, delta,
    stride_sb, stride_sh, stride_sk, stride_sv,
    kp, dp, gp, P, N, i_v, i_bh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHAIN: tl.constexpr, HAS_PENDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAM_FIRST: tl.constexpr, PREFETCH_STATE: tl.constexpr, RAW_QK: tl.constexpr, q_scale, k_out,
):
    """The whole parallel form of one (batch, head, V tile): `_parallel_kernel`'s program
    (i_v, i_bh), or a unit of a persistent kernel's phase.

    One pass over K builds K K^T, Q K^T, K S0 and Q S0 (after folding `pending` into the
    program's S0 tile and writing it back). A is strictly lower triangular, so nilpotent
    (A^16 = 0), and (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8): the solve is a few
    dependent products instead of N dependent row steps. Its terms can be much larger than
    the result (entries of A^n up to binomial(N, n) when every key is the same and beta ~ 1:
    relative error 1e-4 at N = 16 in that worst case), so one step of refinement follows
    where some |A_ij| > 1/2.

    GRAM_FIRST orders it for latency: K K^T, Q K^T and (I + A)^-1 are built from the keys
    and queries alone first, and the pass over the state computes only K S0 and Q S0; after
    it, u and o are one product each. With PREFETCH_STATE the state tile's lines are asked of
    L2 before that, so its trip from HBM overlaps the products and the pending fold reads it
    from L2 (no registers held across them).

    RAW_QK: q and k hold the conv's raw rows; a pass over them first takes each row's l2 norm
    (`_qk_scales`), every later load scales its rows, and the V tile 0 writes the normed keys
    (the commit's factors) to k_out. So the units that project and convolve q and k need not
    each hold a whole head.
    """
    i_b, i_h, i_bh, o_n, m_n, rows, o_v = _node_tile(N, H, BN, BV, i_v, i_bh)
    p_S = S + i_b * stride_sb + i_h * stride_sh + o_v[None, :] * stride_sv
    ks_all = tl.arange(0, K)
    if GRAM_FIRST and PREFETCH_STATE:
        # the first line of each of the tile's rows: all of it for BV <= 32
        l2_prefetch_lines(S + i_b * stride_sb + i_h * stride_sh + i_v * BV * stride_sv + ks_all * stride_sk)
    anc, G, decay = _tree_paths(g, parents, o_n, m_n, i_b, i_h, N, H, CHAIN)
    rq, rk = _qk_scales(q, k, rows, m_n, q_scale, K, BN, BK, RAW_QK)
    if GRAM_FIRST:
        # beta and v loaded before the pass over the state, whose loop they would wait behind
        b_beta = tl.load(beta + rows, mask=m_n, other=0.).to(tl.float32)
        b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
        strict = anc & (o_n[:, None] != o_n[None, :])
        kk, qk = _gram(q, k, rows, m_n, rq, rk, K, BN, BK, DOT_PRECISION, RAW_QK)
        A = tl.where(strict, b_beta[:, None] * decay * kk, 0.)
        T = _unit_lower_inverse(A, o_n, DOT_PRECISION)
    else:
        kk = tl.zeros([BN, BN], dtype=tl.float32)
        qk = tl.zeros([BN, BN], dtype=tl.float32)

    ks = tl.zeros([BN, BV], dtype=tl.float32)               # K S0
    qs = tl.zeros([BN, BV], dtype=tl.float32)               # Q S0
    if HAS_PENDING:
        # the deferred commit on the whole [K, BV] tile first, as the walk does: folded block
        # by block inside the K pass it cost 2 us a block (H200, GDN-1.3B shape), and in closed
        # form inside it (K S = e^G_T K S0 + (K Kp'^T) Dp) 23.3 us a layer against 13.2 for 9
        # nodes and 8 pending factors (H100, benchmarks/results/h100/session25/)
        h = _fold_pending(tl.load(p_S + ks_all[:, None] * stride_sk), kp, dp, gp, i_b, i_h, P,
                          ks_all, o_v, H, K, V)
        tl.store(p_S + ks_all[:, None] * stride_sk, h)
        tl.debug_barrier()        # the pass below reads the tile through other threads
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_S = tl.load(p_S + o_k[:, None] * stride_sk)
        b_q, b_k = _qk_block(q, k, rows, m_n, o_k, rq, rk, K, RAW_QK)
        if RAW_QK:
            if i_v == 0:
                tl.store(k_out + rows[:, None] * K + o_k[None, :], b_k, mask=m_n[:, None])
        if not GRAM_FIRST:
            kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
            qk += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
        ks += tl.dot(b_k, b_S, input_precision=DOT_PRECISION)
        qs += tl.dot(b_q, b_S, input_precision=DOT_PRECISION)

    if not GRAM_FIRST:
        b_beta = tl.load(beta + rows, mask=m_n, other=0.).to(tl.float32)
        strict = anc & (o_n[:, None] != o_n[None, :])
        A = tl.where(strict, b_beta[:, None] * decay * kk, 0.)
        b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_n[:, None], other=0.).to(tl.float32)
    eG = tl.exp(G)
    rhs = b_beta[:, None] * (b_v - eG[:, None] * ks)
    # where some |A_ij| > 1/2, one step of refinement: the residual's terms are bounded (|A| <= 1,
    # u bounded), so it is accurate where the product form's large intermediate terms are not.
    # With every |A_ij| <= 1/2 they stay small: relative error 8e-7 at N = 16 unrefined.
    refine = tl.max(tl.max(tl.abs(A), 1), 0) > 0.5
    if GRAM_FIRST:
        u = tl.dot(T, rhs, input_precision=DOT_PRECISION)
        if refine:
            u += tl.dot(T, rhs - u - tl.dot(A, u, input_precision=DOT_PRECISION),
                        input_precision=DOT_PRECISION)
    else:
        A2 = tl.dot(A, A, input_precision=DOT_PRECISION)
        A4 = tl.dot(A2, A2, input_precision=DOT_PRECISION)
        A8 = tl.dot(A4, A4, input_precision=DOT_PRECISION)
        u = _inverse_times(A, A2, A4, A8, rhs, DOT_PRECISION)
        if refine:
            u += _inverse_times(A, A2, A4, A8, rhs - u - tl.dot(A, u, input_precision=DOT_PRECISION),
                                DOT_PRECISION)
    b_o = eG[:, None] * qs + tl.dot(decay * qk, u, input_precision=DOT_PRECISION)
    m_out = m_n[:, None]
    tl.store(o + rows[:, None] * V + o_v[None, :], b_o, mask=m_out)
    tl.store(delta + rows[:, None] * V + o_v[None, :], u, mask=m_out)


@triton.jit(do_not_specialize=["P", "N"])
def _parallel_kernel(
    q, k, v, g, beta, parents, S, o, delta,
    stride_sb, stride_sh, stride_sk, stride_sv,
    kp, dp, gp, P, N,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHAIN: tl.constexpr, HAS_PENDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAM_FIRST: tl.constexpr, PREFETCH_STATE: tl.constexpr,
):
    """The whole parallel form of one (batch, head, V tile) a program (`_parallel_tile`)."""
    _parallel_tile(q, k, v, g, beta, parents, S, o, delta, stride_sb, stride_sh, stride_sk, stride_sv,
                   kp, dp, gp, P, N, tl.program_id(0), tl.program_id(1), H, K, V, BN, BK, BV,
                   CHAIN, HAS_PENDING, DOT_PRECISION, GRAM_FIRST, PREFETCH_STATE, False, 1.0, k)


def _parallel_config(N: int, K: int, V: int, block_v: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     gram_first: bool | None = None) -> dict:
    BN = 16                                      # tl.dot's smallest tile; N <= 16
    # K blocks of 32: 5.2 us a layer against 7.7 for 64 at the embedded shape (K = 64), equal
    # at the 1.3B one (13.1, 12.9); 16 V columns and 4 warps were the best of the sweep
    cfg = dict(BN=BN, BK=min(K, block_k or 32), BV=min(V, block_v or 16), num_warps=num_warps or 4,
               GRAM_FIRST=PARALLEL_GRAM_FIRST if gram_first is None else gram_first)
    if num_stages is not None:
        cfg["num_stages"] = num_stages
    return cfg


def _parallel_verify(q, k, v, g, beta, S0, parents, chain_nodes, pending, o, delta,
                     block_v=None, block_k=None, num_warps=None, dot_precision=None, num_stages=None,
                     gram_first=None):
    B, N, H, K = q.shape
    V = v.shape[-1]
    cfg = _parallel_config(N, K, V, block_v, block_k, num_warps, num_stages, gram_first)
    launch = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    kp, dp, gp, P, has_pending = _pending_args(pending, q)
    _parallel_kernel[(V // cfg["BV"], B * H)](
        q, k, v, g, beta, parents, S0, o, delta, *_strides(S0),
        kp, dp, gp, P, N,
        H=H, K=K, V=V, BN=cfg["BN"], BK=cfg["BK"], BV=cfg["BV"],
        CHAIN=chain_nodes, HAS_PENDING=has_pending, DOT_PRECISION=dot_precision or PARALLEL_DOT_PRECISION,
        GRAM_FIRST=cfg["GRAM_FIRST"], PREFETCH_STATE=cfg["GRAM_FIRST"] and l2_prefetch_applies(q.device),
        **launch)


def _tree_config(N: int, K: int, V: int, block_v: int | None = None) -> dict:
    """Tiles and warps of the two tree kernels, chosen from ptxas reports for sm_90 (no
    spills up to BN=64 at K=256; BN=128's gram kernel spills a few hundred bytes).
    Narrow V tiles (16) give the solve kernel more programs: its row loop is serial."""
    BN = max(16, triton.next_power_of_2(N))
    return dict(BN=BN, BK_gram=min(K, 32 if BN <= 16 else 16),
                warps_gram={16: 4, 32: 8}.get(BN, 16),
                BK=min(K, 32), BV=min(V, block_v or 16),
                warps_solve={16: 4, 32: 8, 64: 8}.get(BN, 16))


def _tree_verify(q, k, v, g, beta, S0, parents, pending, o, delta, block_v, form: str,
                 **parallel_options):
    B, N, H, K = q.shape
    V = v.shape[-1]
    if N > MAX_TREE_NODES:
        raise ValueError(f"tree verification holds [N, N] tiles on chip: N={N} nodes exceeds "
                         f"{MAX_TREE_NODES}; use hybrid for larger trees")
    if parents.shape != (N,) or parents.device != q.device:
        raise ValueError(f"topo.parents must be a [{N}] tensor on {q.device}, got "
                         f"{tuple(parents.shape)} on {parents.device}")
    if form == "parallel":
        _parallel_verify(q, k, v, g, beta, S0, parents, False, pending, o, delta, block_v,
                         **parallel_options)
        return
    cfg = _tree_config(N, K, V, block_v)
    BN = cfg["BN"]
    A = torch.empty((B * H, BN, BN), device=q.device, dtype=torch.float32)
    Pm = torch.empty_like(A)
    G = torch.empty((B * H, BN), device=q.device, dtype=torch.float32)
    _tree_gram_kernel[(B * H,)](q, k, g, beta, parents, A, Pm, G, N,
                                H=H, K=K, BN=BN, BK=cfg["BK_gram"], DOT_PRECISION=DOT_PRECISION,
                                num_warps=cfg["warps_gram"])
    kp, dp, gp, P, has_pending = _pending_args(pending, q)
    _tree_solve_kernel[(V // cfg["BV"], B * H)](
        q, k, v, beta, S0, o, delta, A, Pm, G, *_strides(S0),
        kp, dp, gp, P, N,
        H=H, K=K, V=V, BN=BN, BK=cfg["BK"], BV=cfg["BV"], HAS_PENDING=has_pending,
        DOT_PRECISION=DOT_PRECISION, num_warps=cfg["warps_solve"])


# ---------------------------------------------------------------------------------------
# Commit: fold accepted factors into the state
#   reference: commit_ref
# ---------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["P"])
def _commit_kernel(S, stride_sb, stride_sh, stride_sk, stride_sv, kp, dp, gp, P,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """One program per (batch, head, V tile): load the tile, fold the P factors, store once."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    ks, vs = tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    p_S = S + i_b * stride_sb + i_h * stride_sh + ks[:, None] * stride_sk + vs[None, :] * stride_sv
    h = _fold_pending(tl.load(p_S), kp, dp, gp, i_b, i_h, P, ks, vs, H, K, V)
    tl.store(p_S, h)


def commit(S: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, *,
           block_v: int | None = None, num_warps: int | None = None) -> None:
    """Fold T accepted factors (k [B,T,H,K], delta [B,T,H,V], g [B,T,H]) into S in place."""
    if S.dim() != 4:
        raise ValueError(f"S must be [B, H, K, V], got shape {tuple(S.shape)}")
    B, H, K, V = S.shape
    T = k.shape[1] if k.dim() == 4 else -1
    for name, t, shape in (("k", k, (B, T, H, K)), ("delta", delta, (B, T, H, V)), ("g", g, (B, T, H))):
        if tuple(t.shape) != shape:
            raise ValueError(f"commit: {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.device != S.device:
            raise ValueError(f"commit: {name} is on {t.device} but S is on {S.device}")
    if not supports(K, V):
        raise ValueError(f"commit: K={K} must be a power of two in [16, {MAX_K}] and V={V} "
                         f"one in [16, {MAX_V}]")
    if S.dtype != torch.float32:
        raise ValueError(f"commit: the state must be float32, got {S.dtype}")
    if T == 0:
        return
    BV, warps = _walk_config(B * H, K, V, block_v, num_warps)
    k, delta, g = _contig(k, delta, g)
    _commit_kernel[(V // BV, B * H)](S, *_strides(S), k, delta, g, T,
                                     H=H, K=K, V=V, BV=BV, num_warps=warps)


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------

def verify(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, S0: torch.Tensor, topo,
           pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
           out: tuple[torch.Tensor, torch.Tensor] | None = None,
           block_v: int | None = None, num_warps: int | None = None, v_first: bool | None = None,
           form: str | None = None, block_k: int | None = None, dot_precision: str | None = None,
           num_stages: int | None = None, gram_first: bool | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and deltas [B,N,H,V] fp32 of every node of `topo` for one layer.

    mode: "chain" (nodes 0..N-1 form a chain; `topo` is not read), "tree" (reads
    `topo.parents` on the device) or "hybrid" (reads/creates the schedule in `topo.cache`).
    pending: accepted factors of the previous step, folded into S0 in place first (the
    deferred commit; fused into the verify kernel, except for a hybrid whose first wave
    has several chains, where the commit kernel runs first).
    out: optional preallocated (o, delta), contiguous [B,N,H,V], delta fp32 and o fp32 or
    rounded to bf16 / fp16 on store (static buffers for a CUDA graph; tests poison them).
    form: which kernel computes the mode (FORMS; None picks by N): a chain's serial "walk"
    or one-launch "parallel" form (6 <= N <= 16), a tree's one-launch "parallel" form
    (N <= 16) or its two-launch "gram_solve".
    For benchmarking, block_v overrides the V tile (every form), num_warps the warps,
    v_first the walk's tile orientation, block_k, dot_precision, num_stages and gram_first
    the parallel form's K block, tl.dot precision, pipeline depth and order.
    """
    if mode not in MODES:
        raise ValueError(f"unknown verification mode {mode!r}; the kernels do {', '.join(MODES)}")
    if form is not None and form not in FORMS[mode]:
        raise ValueError(f"{mode} verification has no form {form!r}; it has {', '.join(FORMS[mode])}")
    B, N, H, K, V, P = _check_inputs(q, k, v, g, beta, S0, pending)
    if block_v is not None and (not _is_pow2(block_v) or not 16 <= block_v <= V):
        raise ValueError(f"block_v={block_v} must be a power of two in [16, V={V}]")
    q, k, v, g, beta = _contig(q, k, v, g, beta)
    if P == 0:
        pending = None
    if out is None:
        o = torch.empty((B, N, H, V), device=q.device, dtype=torch.float32)
        delta = torch.empty_like(o)
    else:
        o, delta = out
        for t, dtypes in ((o, OUT_DTYPES), (delta, (torch.float32,))):
            if t.shape != (B, N, H, V) or t.dtype not in dtypes or not t.is_contiguous() \
                    or t.device != q.device:
                raise ValueError(f"out tensors must be contiguous [B, N, H, V] = {(B, N, H, V)} "
                                 f"on {q.device}, delta float32 and o one of {OUT_DTYPES}")
    if form is None and mode == "tree":
        form = "parallel" if N <= PARALLEL_MAX_NODES else "gram_solve"
    elif form is None and mode == "chain":
        form = "parallel" if CHAIN_PARALLEL_MIN_NODES <= N <= PARALLEL_MAX_NODES else "walk"
    if form == "parallel" and N > PARALLEL_MAX_NODES:
        raise ValueError(f"the one-launch parallel form takes up to {PARALLEL_MAX_NODES} nodes, not {N}")
    parallel_options = dict(block_k=block_k, num_warps=num_warps, dot_precision=dot_precision,
                            num_stages=num_stages, gram_first=gram_first)
    if mode == "chain" and form == "walk":
        _chain_verify(q, k, v, g, beta, S0, pending, o, delta, block_v, num_warps, v_first)
    elif mode == "chain":
        _parallel_verify(q, k, v, g, beta, S0, q, True, pending, o, delta, block_v, **parallel_options)
    elif mode == "tree":
        _tree_verify(q, k, v, g, beta, S0, topo.parents, pending, o, delta, block_v, form,
                     **parallel_options)
    else:
        if len(topo.tree.parents) != N:
            raise ValueError(f"topology has {len(topo.tree.parents)} nodes but the inputs {N}")
        _hybrid_verify(q, k, v, g, beta, S0, hybrid_schedule(topo, q.device), pending, o, delta,
                       block_v, num_warps, v_first=v_first)
    return o, delta

