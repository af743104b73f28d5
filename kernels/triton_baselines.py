"""Baselines for benchmarks/bench_kernels.py: what verifying a draft costs without SpecLA's
per-token factors, one token launch a node (a replay that writes every node's state, as a
decode step does) or the state-resident walk writing every node's full state (vLLM / SGLang
style). Not used by the engine."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_verify import _hybrid_verify, _walk_config, hybrid_schedule

@triton.jit(do_not_specialize=["node", "N"])
def _token_step_kernel(S_in, S_out, q, k, v, g, beta, o, delta, node, N,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """One token from a state in memory to a state in memory (S_in, S_out [B,H,K,V]
    contiguous; may alias): what a one-token decode step or a replay does per token."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, K)[:, None]
    o_v = i_v * BV + tl.arange(0, BV)[None, :]
    o_tile = i_bh.to(tl.int64) * K * V + o_k * V + o_v
    h = tl.load(S_in + o_tile)
    row = (i_b * N + node) * H + i_h
    b_q = tl.load(q + row * K + o_k).to(tl.float32)
    b_k = tl.load(k + row * K + o_k).to(tl.float32)
    b_v = tl.load(v + row * V + o_v).to(tl.float32)
    h = h * tl.exp(tl.load(g + row).to(tl.float32))
    b_d = tl.load(beta + row).to(tl.float32) * (b_v - tl.sum(h * b_k, 0, keep_dims=True))
    h = h + b_k * b_d
    tl.store(o + row * V + o_v, tl.sum(h * b_q, 0, keep_dims=True))
    tl.store(delta + row * V + o_v, b_d)
    tl.store(S_out + o_tile, h)


def token_step(S_in, S_out, q, k, v, g, beta, o, delta, node: int, *,
               block_v: int | None = None, num_warps: int | None = None) -> None:
    """Launch one token step (node `node` of q..beta [B,N,H,*]); all tensors contiguous."""
    B, N, H, K = q.shape
    V = v.shape[-1]
    BV, warps = _walk_config(B * H, K, V, block_v, num_warps)
    _token_step_kernel[(V // BV, B * H)](S_in, S_out, q, k, v, g, beta, o, delta, node, N,
                                         H=H, K=K, V=V, BV=BV, num_warps=warps)


def sequential_replay_verify(q, k, v, g, beta, S0, parents: list[int], snapshots=None):
    """Baseline: N one-token launches, each reading its parent's state from memory and
    writing a dense state snapshot for its node. snapshots: [N, B, H, K, V] fp32."""
    B, N, H, K = q.shape
    V = v.shape[-1]
    if snapshots is None:
        snapshots = torch.empty((N, B, H, K, V), device=q.device, dtype=torch.float32)
    o = torch.empty((B, N, H, V), device=q.device, dtype=torch.float32)
    delta = torch.empty_like(o)
    for i, p in enumerate(parents):
        token_step(S0 if p < 0 else snapshots[p], snapshots[i], q, k, v, g, beta, o, delta, i)
    return o, delta, snapshots


def dense_snapshot_verify(q, k, v, g, beta, S0, topo, snapshots=None):
    """Baseline (vLLM / SGLang style): the state-resident walk that also writes every
    node's full state. Same kernel as the hybrid, with a slot for every node."""
    B, N, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty((B, N, H, V), device=q.device, dtype=torch.float32)
    delta = torch.empty_like(o)
    sched = hybrid_schedule(topo, q.device, every_node=True)
    snapshots = _hybrid_verify(q, k, v, g, beta, S0, sched, None, o, delta, scratch=snapshots)
    return o, delta, snapshots
