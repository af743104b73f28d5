"""Micro-benchmark of the verify / commit kernels at the GDN-1.3B head shape, on a GPU.

    python benchmarks/bench_kernels.py --out DIR [--quick] [--layers 48]

One layer: B=1, H=8, K=V=256, fp32 state (2 MiB). Every variant is captured in a CUDA
graph that calls it once per layer over `--layers` distinct layer states (48 x 2 MiB, more
than the H200's L2, so the state comes from HBM as in a real forward), replayed many times
and timed with CUDA events; a sample is one replay divided by the layer count, i.e. the
cost of the variant for one layer inside a graph. Timed, over draft sizes N = 1..64 (128):

  verify   chain kernel | tree kernel | hybrid kernel  on chains and on trees
           sequential replay: N one-token launches, each reading its parent's state from
           HBM and writing a dense snapshot | dense snapshot: the walk writing N states
  commit   factor commit of T accepted tokens vs token replay (T one-token steps that
           recompute delta), T = 1..16
  deferred fused fold + verify vs commit kernel then verify (P = 4)
  parallel the one-launch parallel form against the walk and the gram + solve pair, N <= 16,
           at the 1.3B and the embedded head shapes, and its tilings
  pdl      a model's fused projections back to back, with and without programmatic
           dependent launch
  barrier  a grid-wide barrier inside a persistent launch against an empty launch in a
           graph (plain and PDL): what a phase boundary costs by itself
  memory   factor bytes vs dense snapshot bytes per node
  projection  the fused projections' tilings against fla's norm kernel + cuBLAS, bf16, at the
           embedded model's widths and the 1.3B shape's, 1 and 9 rows (issue #15's sweep)

Writes DIR/kernels.json (every timing with median, min, max and sample count, plus kernel
register/spill counts and a few correctness checks) and DIR/verify_cost.json (`auto_rule`
for specla/costmodel.py, fitted from these timings, plus the raw timings), and prints a
Markdown summary last. Each variant runs in its own try/except: a failure is recorded and
the rest still run.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import reference  # noqa: E402
from kernels.pdl import gdc_launch_dependents, gdc_wait, grid_arrive, grid_wait  # noqa: E402

B, H, K, V = 1, 8, 256, 256
SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_DRAFT_NODES = 256          # specla.tree.MAX_TREE_NODES: the largest draft the runtime takes


@triton.jit
def _barriers_kernel(counter, status, PHASES: tl.constexpr):
    """PHASES grid-wide barriers and nothing else; the last arrival re-arms the counter."""
    programs = tl.num_programs(0)
    for i in range(PHASES):
        grid_arrive(counter)
        grid_wait(counter, (i + 1) * programs, status)
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if last == (PHASES + 1) * programs - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _empty_kernel(flag, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(flag, 0)


# ---------------------------------------------------------------------------------------
# Draft topologies (parent lists; tests/test_kernels.py uses these too)
# ---------------------------------------------------------------------------------------

def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def wide_shallow(n: int, width: int = 8) -> list[int]:
    """Root, up to `width` children, then grandchildren spread over them round-robin."""
    level1 = list(range(1, min(n, width + 1)))
    return [-1] + [0] * len(level1) + [level1[i % len(level1)] for i in range(n - 1 - len(level1))]


def deep_narrow(n: int) -> list[int]:
    """A long main chain with a 2-node side branch leaving every 4th node."""
    parents, main = [-1], 0
    while len(parents) < n:
        parents.append(main)
        main = len(parents) - 1
        if main % 4 == 0 and len(parents) + 2 <= n:
            parents += [main - 1, len(parents)]
    return parents[:n]


def random_tree(n: int, seed: int = 0) -> list[int]:
    """Random recursive tree: each node picks a uniformly random earlier parent."""
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


TREES = {"random": random_tree, "wide": wide_shallow, "deep": deep_narrow}


def depth_of(parents: list[int]) -> int:
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    return max(depth)


class Topo:
    """What triton_verify reads from specla.model.Topology: tree.parents, parents, cache."""

    def __init__(self, parents: list[int], device):
        self.tree = type("Tree", (), {"parents": parents})()
        self.parents = torch.tensor(parents, device=device)
        self.cache: dict = {}


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------

def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "reps": len(samples)}


def time_graph(call_layer, layers: int, repeats: int, replays: int) -> dict:
    """Per-layer microseconds of `call_layer(l)` captured for l in range(layers), in one graph."""
    call_layer(0)                            # compile, build caches (before capture)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call_layer(1 % layers)               # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            call_layer(layer)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples, rep_medians = [], []
    for _ in range(repeats):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(replays)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        rep = [1e3 * s.elapsed_time(e) / layers for s, e in events]
        samples += rep
        rep_medians.append(statistics.median(rep))
    del graph
    out = {"us": stats(samples), "repeat_medians_us": rep_medians}
    return out


def copy_bandwidth(device) -> dict:
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s)."""
    n = 1 << 28
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    a.normal_()
    samples = []
    for _ in range(3):
        b.copy_(a)
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        samples.append(2 * a.numel() * 4 / (start.elapsed_time(end) * 1e-3) / 1e9)
    return stats(samples)


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

def node_inputs(n: int, device, seed: int, heads: int = H, key: int = K, value: int = V) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=F.normalize(torch.randn(B, n, heads, key, generator=gen), dim=-1) * key ** -0.5,
             k=F.normalize(torch.randn(B, n, heads, key, generator=gen), dim=-1),
             v=torch.randn(B, n, heads, value, generator=gen),
             g=-torch.rand(B, n, heads, generator=gen), beta=torch.rand(B, n, heads, generator=gen))
    return {name: t.to(device) for name, t in x.items()}


def factors(t: int, device, seed: int, heads: int = H, key: int = K, value: int = V) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return (F.normalize(torch.randn(B, t, heads, key, generator=gen), dim=-1).to(device),
            (0.5 * torch.randn(B, t, heads, value, generator=gen)).to(device),
            (-torch.rand(B, t, heads, generator=gen)).to(device))


# ---------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------
# Fused projections: shapes, inputs, tilings
# ---------------------------------------------------------------------------------------

def projection_models() -> dict:
    """The embedded model's config (assets/target) and the GDN-1.3B public shape."""
    from specla.config import PUBLIC_1P3B, GDNConfig

    models = {"gdn-1.3b": PUBLIC_1P3B}
    path = Path(__file__).resolve().parent.parent / "assets" / "target" / "config.json"
    if path.exists():
        models = {"embedded": GDNConfig.from_dict(json.loads(path.read_text())), **models}
    return models


def projection_shapes(config) -> dict[str, tuple[str, int, int]]:
    """(prologue, K, N) of the four projections of one layer that fuse an op in front."""
    D, H = config.hidden_size, config.num_heads
    return {"in (norm)": ("norm", D, 2 * config.key_dim + 2 * config.value_dim + 2 * H),
            "mlp up (norm)": ("norm", D, 2 * config.mlp_size),
            "out (gated norm)": ("gated_norm", config.value_dim, D),
            "mlp down (swiglu)": ("swiglu", config.mlp_size, D)}


def projection_inputs(prologue: str, M: int, K: int, N: int, config, device, seed: int) -> dict:
    """bf16 inputs of one projection call for M rows, as a decode step has them."""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape, dt=torch.bfloat16: torch.randn(*shape, generator=g, device=device).to(dt)  # noqa: E731
    w = rnd(N, K) * K ** -0.5
    if prologue == "norm":
        return {"x": rnd(M, K), "residual": rnd(M, K), "norm_w": rnd(K) * 0.1 + 1, "w": w}
    if prologue == "gated_norm":
        H, Vh = config.num_heads, config.head_v_dim
        return {"o": rnd(M, H, Vh, dt=torch.float32), "gate": rnd(M, H * Vh), "norm_w": rnd(Vh) * 0.1 + 1,
                "w": w, "activation": config.output_gate_activation}
    return {"gate_up": rnd(M, 2 * K), "w": w}


def project(ops, prologue: str, i: dict, **blocks) -> torch.Tensor:
    """One projection through `ops` (FlaOps, or the triton_projection module with `blocks`)."""
    if prologue == "norm":
        return ops.norm_linear(i["x"], i["norm_w"], 1e-6, i["residual"], i["w"], **blocks)[0]
    if prologue == "gated_norm":
        return ops.gated_norm_linear(i["o"], i["gate"], i["norm_w"], 1e-6, i["activation"], i["w"], **blocks)
    return ops.swiglu_linear(i["gate_up"], i["w"], **blocks)


def projection_tilings(prologue: str, K: int, quick: bool, M: int = 1, head: int = 0) -> list[dict]:
    """The kernel's own pick ({}) and around it: for a row or two the GEMV form, block_k x
    block_n x split_k (no tl.dot, so no stages to pipeline); the tl.dot form, block_k x block_n
    x num_stages x split_k. The gated norm's K blocks are whole heads of `head` columns; a
    split_k is kept only where K has that many blocks (the kernel would run fewer slices).
    At most 36 tilings a shape, 13 quick."""
    from kernels.triton_projection import MAX_GEMV_ROWS

    widest = max(head, 1 << (K - 1).bit_length())   # a K block past K's next power of 2 is all mask

    def blocks_k(options):
        fit = [bk for bk in options if bk <= widest and bk % max(head, 1) == 0]
        return fit or [widest if head > widest else head]

    def splits(bk, options):
        k_blocks = -(-K // bk)
        per_slice = lambda s: -(-k_blocks // s)  # noqa: E731 - K blocks a slice
        return [s for s in options if -(-k_blocks // per_slice(s)) == s]      # the slices that run

    gemv = M <= MAX_GEMV_ROWS
    if quick:
        g_ks, g_ns, g_splits = (256, 512), (4, 8), (1, 4)
        d_ks, d_ns, stages, d_splits = (256,), (16,), (3,), (1, 4)
        if not gemv:
            d_ks, stages, d_splits = (128, 256), (1, 3), (1, 2, 4)
    else:
        # GEMV block_n 16 and tl.dot block_k 512 spill (ptxas, sm_90): not timed
        g_ks, g_ns, g_splits = (256, 512, 1024), (2, 4, 8), (1, 2, 4)
        d_ks, d_ns, stages = (128, 256), (16, 32), (1, 3)
        d_splits = (1, 4) if gemv else (1, 2, 4, 8)
    tilings = [{}]
    if gemv:
        tilings += [{"gemv": True, "block_k": bk, "block_n": bn, "split_k": s}
                    for bk in blocks_k(g_ks) for bn in g_ns for s in splits(bk, g_splits)]
        if not quick:      # the tl.dot form at a row or two: its 16-row blocks only
            d_ns = (16,)
    tilings += [{"gemv": False, "block_k": bk, "block_n": bn, "num_stages": st, "split_k": s}
                for bk in blocks_k(d_ks) for bn in d_ns for st in stages for s in splits(bk, d_splits)]
    return tilings


def swapped_tilings(K: int, quick: bool, head: int = 0) -> list[dict]:
    """The tl.dot form with the weight tile on the MMA's M side (`swap`): block_n (weight
    rows a tile, 64 or more for Hopper's warpgroup MMA) x block_k x num_stages x split_k,
    whole heads for the gated norm, each with the prologue's inputs loaded a K block ahead
    (`preload`) and not. At most 32 tilings a shape, 8 quick."""
    ns, ks, stages, splits = ((64, 128), (128,), (4,), (1, 4)) if quick else ((64, 128), (64, 128), (4,), (1, 2, 4, 8))
    k_blocks = lambda bk: -(-K // bk)  # noqa: E731
    runs = lambda bk, s: -(-k_blocks(bk) // -(-k_blocks(bk) // s)) == s  # noqa: E731 - the slices that run
    fit = [bk for bk in ks if bk % max(head, 1) == 0] or [head]
    return [{"swap": True, "block_n": bn, "block_k": bk, "num_stages": st, "split_k": s, "preload": pre}
            for bn in ns for bk in fit for st in stages for s in splits if runs(bk, s) for pre in (False, True)]


def tiling_form(blocks: dict) -> str:
    """Which form of the fused projection a tiling asks for: default, gemv, dot or swap."""
    if not blocks:
        return "default"
    return "swap" if blocks.get("swap") else "gemv" if blocks.get("gemv") else "dot"


# ---------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        from kernels import triton_baselines, triton_verify
        self.tv, self.baselines = triton_verify, triton_baselines
        self.dev = torch.device("cuda")
        self.layers = args.layers
        self.repeats, self.replays = (3, 20) if args.quick else (5, 40)
        self.states = torch.randn(self.layers, B, H, K, V, device=self.dev)
        self.results: list[dict] = []
        self.errors: list[dict] = []
        self.t0 = time.time()

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)

    def run(self, name: str, call_layer, **info) -> dict | None:
        """Time one variant; record it (or its error) and return the record."""
        label = f"{name} " + " ".join(f"{k}={v}" for k, v in info.items())
        try:
            timing = time_graph(call_layer, self.layers, self.repeats, self.replays)
        except Exception as exc:                                   # keep going
            self.errors.append({"name": name, **info, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(limit=4)})
            self.log(f"FAILED {label}: {type(exc).__name__}: {str(exc)[:300]}")
            try:
                torch.cuda.synchronize()
            except Exception:          # a broken context fails every later variant too
                pass
            return None
        record = {"name": name, **info, **timing}
        self.results.append(record)
        self.log(f"{label}: {timing['us']['median']:.2f} us/layer")
        return record

    # -- verification -------------------------------------------------------------------

    def verify_variants(self, sizes) -> None:
        tv = self.tv
        for n in sizes:
            x = node_inputs(n, self.dev, seed=n)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            topos = {"chain": chain(n)}
            if n >= 4:
                topos.update({name: make(n) for name, make in TREES.items()})
            for topo_name, parents in topos.items():
                topo = Topo(parents, self.dev)
                tv.prepare_topology(topo, self.dev)
                info = dict(topology=topo_name, N=n, depth=depth_of(parents))
                modes = ("chain", "tree", "hybrid") if topo_name == "chain" else ("tree", "hybrid")
                for mode in modes:
                    if mode == "tree" and n > tv.MAX_TREE_NODES:
                        continue
                    self.run(mode, lambda l, mode=mode, topo=topo: tv.verify(
                        mode, *args, self.states[l], topo), **info)
                if n > 64:
                    continue
                snaps = torch.empty(self.layers, n, B, H, K, V, device=self.dev)
                self.run("sequential_replay", lambda l, parents=parents: self.baselines.sequential_replay_verify(
                    *args, self.states[l], parents, snapshots=snaps[l]), **info)
                self.run("dense_snapshot", lambda l, topo=topo: self.baselines.dense_snapshot_verify(
                    *args, self.states[l], topo, snapshots=snaps[l]), **info)
                del snaps

    def walk_sweep(self, sizes=(9, 16), pending: int = 9) -> None:
        """Tile width, warps and orientation of the chain kernel (the defaults come from
        _walk_config), folding a deferred commit of `pending` factors first as decoding does,
        at this bench's shape and at the embedded model's (H=6, K=V=64); and the tree
        kernels' tile width."""
        tv = self.tv
        shapes = {"gdn-1.3b": (H, K, V, self.states),
                  "embedded": (6, 64, 64, torch.randn(self.layers, B, 6, 64, 64, device=self.dev))}
        for model, (heads, key, value, states) in shapes.items():
            for n in sizes:
                x = node_inputs(n, self.dev, seed=n, heads=heads, key=key, value=value)
                args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
                folded = factors(pending, self.dev, seed=n + 1, heads=heads, key=key, value=value)
                topo = Topo(chain(n), self.dev)
                for bv in (16, 32, 64):
                    for warps in (1, 2, 4, 8):
                        for v_first in (False, True):
                            # a tile too small to split that far, or over 128 floats a thread
                            # (those spill: 0.4-1.2 ms a layer at the 1.3B shape, session 10)
                            if bv > value or key * bv // warps > 4096 or (warps > 1 and key * bv // warps < 256):
                                continue
                            self.run("chain_sweep", lambda l, bv=bv, warps=warps, v_first=v_first: tv.verify(
                                "chain", *args, states[l], topo, pending=folded, block_v=bv,
                                num_warps=warps, v_first=v_first),
                                model=model, topology="chain", N=n, P=pending, block_v=bv,
                                num_warps=warps, v_first=v_first)
                self.run("chain_sweep_default", lambda l: tv.verify(
                    "chain", *args, states[l], topo, pending=folded),
                    model=model, topology="chain", N=n, P=pending)
        for n in (16, 64):
            x = node_inputs(n, self.dev, seed=n)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            for bv in (16, 32):
                parents = random_tree(n)
                ttopo = Topo(parents, self.dev)
                self.run("tree_sweep", lambda l, bv=bv: tv.verify(
                    "tree", *args, self.states[l], ttopo, block_v=bv),
                    topology="random", N=n, depth=depth_of(parents), block_v=bv)

    def parallel_sweep(self, sizes=(4, 9, 16), pending: int = 8, configs: list[dict] | None = None,
                       models: tuple[str, ...] = ()) -> None:
        """The one-launch parallel form against the walk (chains) and the two-launch
        gram + solve (trees), at this bench's shape and the embedded model's, with and
        without a deferred commit of `pending` factors; and its K block, warps and V tile on
        a chain of 9 (8 drafts and the root) and a random tree of 16. `configs` (keyword
        dicts of `verify`) replace the tilings swept there, each checked against the
        reference before it is timed; `models` limits the shapes."""
        tv = self.tv
        shapes = {"embedded": (6, 64, 64, torch.randn(self.layers, B, 6, 64, 64, device=self.dev)),
                  "gdn-1.3b": (H, K, V, self.states)}
        for model, (heads, key, value, states) in shapes.items():
            if models and model not in models:
                continue
            for n in sizes:
                x = node_inputs(n, self.dev, seed=n, heads=heads, key=key, value=value)
                args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
                folded = factors(pending, self.dev, seed=n + 1, heads=heads, key=key, value=value)
                topos = {"chain": ("chain", chain(n))}
                if n >= 4:
                    topos["random"] = ("tree", random_tree(n))
                for topo_name, (mode, parents) in topos.items():
                    topo = Topo(parents, self.dev)
                    for P in (0, pending):
                        for form in tv.FORMS[mode]:
                            self.run("form", lambda l, mode=mode, topo=topo, form=form, P=P: tv.verify(
                                mode, *args, states[l], topo, pending=folded if P else None, form=form),
                                model=model, mode=mode, form=form, topology=topo_name, N=n, P=P)
                        if configs is None and (n, topo_name, P) not in ((9, "chain", pending),
                                                                         (16, "random", pending)):
                            continue
                        # around the default (K block 32, 4 warps, 16 V columns)
                        sweep = configs if configs is not None else [
                            dict(block_k=64), dict(num_warps=2), dict(num_warps=8),
                            dict(block_k=key, num_warps=8), dict(block_v=32)]
                        for cfg in sweep:
                            err = self.parallel_error(mode, args, states[0], parents, folded if P else None, cfg)
                            self.run("parallel_sweep", lambda l, mode=mode, topo=topo, cfg=cfg, P=P: tv.verify(
                                mode, *args, states[l], topo, pending=folded if P else None,
                                form="parallel", **cfg),
                                model=model, mode=mode, topology=topo_name, N=n, P=P, rel_err=err, **cfg)

    def parallel_error(self, mode: str, args: tuple, S0: torch.Tensor, parents: list[int], pending,
                       cfg: dict) -> float:
        """The largest relative error of o, delta and the folded state of the parallel form with
        `cfg` against the float64 reference, on a copy of S0."""
        tv = self.tv
        S = S0.clone()
        o, d = tv.verify(mode, *args, S, Topo(parents, self.dev), pending=pending, form="parallel", **cfg)
        cpu = [t.cpu().double() for t in args]
        S_ref = S0.cpu().double()
        if pending is not None:
            S_ref = reference.commit_ref(S_ref, *(t.cpu().double() for t in pending))
        want = reference.tree_verify_ref(*cpu, S_ref, torch.tensor(parents))
        return max(float((got.cpu().double() - ref).norm() / ref.norm())
                   for got, ref in ((o, want[0]), (d, want[1]), (S, S_ref)))

    # -- commit -------------------------------------------------------------------------

    def commit_variants(self, counts=range(1, 17)) -> None:
        tv = self.tv
        for t in counts:
            kp, dp, gp = factors(t, self.dev, seed=t)
            x = node_inputs(t, self.dev, seed=100 + t)
            o = torch.empty(B, t, H, V, device=self.dev)
            d = torch.empty_like(o)
            self.run("factor_commit", lambda l: tv.commit(self.states[l], kp, dp, gp), T=t)

            def replay(l, t=t):
                for i in range(t):   # one-token steps in place, recomputing delta (and o)
                    self.baselines.token_step(self.states[l], self.states[l], x["q"], x["k"], x["v"],
                                              x["g"], x["beta"], o, d, i)
            self.run("token_replay", replay, T=t)

    def deferred_variants(self, sizes=(8, 16), p=4) -> None:
        tv = self.tv
        kp, dp, gp = factors(p, self.dev, seed=7)
        for n in sizes:
            x = node_inputs(n, self.dev, seed=n)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            for topo_name, parents in (("chain", chain(n)), ("random", random_tree(n))):
                topo = Topo(parents, self.dev)
                tv.prepare_topology(topo, self.dev)
                modes = ("chain", "tree", "hybrid") if topo_name == "chain" else ("tree", "hybrid")
                for mode in modes:
                    info = dict(mode=mode, topology=topo_name, N=n, P=p)
                    self.run("deferred", lambda l, mode=mode, topo=topo: tv.verify(
                        mode, *args, self.states[l], topo, pending=(kp, dp, gp)), **info)

                    def immediate(l, mode=mode, topo=topo):
                        tv.commit(self.states[l], kp, dp, gp)
                        tv.verify(mode, *args, self.states[l], topo)
                    self.run("immediate", immediate, **info)

    # -- correctness and resources ------------------------------------------------------

    # -- fused projections ----------------------------------------------------------------

    def pdl_chain(self, rows=(1, 2, 9)) -> None:
        """A whole model's projections back to back in one graph (each layer's own weights,
        so the 1.3B shape's stream from HBM), launched plainly and with programmatic
        dependent launch (`kernels.pdl`); microseconds per layer."""
        from kernels import pdl
        from kernels import triton_projection as tp
        for model, config in projection_models().items():
            shapes = projection_shapes(config)
            for M in rows:
                layers = [{name: projection_inputs(prologue, M, K, N, config, self.dev, seed=97 * l + i)
                           for i, (name, (prologue, K, N)) in enumerate(shapes.items())}
                          for l in range(config.num_hidden_layers)]

                def call_layer(l, layers=layers):
                    for name, (prologue, _, _) in shapes.items():
                        project(tp, prologue, layers[l % len(layers)][name])
                before = pdl.pdl_enabled()
                for on in (False, True):
                    pdl.use_pdl(on)
                    try:
                        self.run("pdl_chain", call_layer, model=model, M=M, pdl=on)
                    finally:
                        pdl.use_pdl(before)
                del layers

    def barrier_cost(self, phases: int = 32, programs=(8, 32, 66, 132)) -> None:
        """What a phase boundary costs with no work around it: `phases` grid-wide barriers
        inside one persistent launch (kernels/pdl.py's, as the whole decode step uses them)
        against `phases` empty launches in a graph, plainly and with programmatic dependent
        launch; microseconds per boundary (a sample divided by `phases`)."""
        counter, status, flag = (torch.zeros(1, device=self.dev, dtype=torch.int32) for _ in range(3))
        sms = torch.cuda.get_device_properties(self.dev).multi_processor_count
        for P in sorted({min(p, sms) for p in programs}):
            rec = self.run("grid_barrier", lambda l, P=P: _barriers_kernel[(P,)](counter, status, phases),
                           programs=P, phases=phases)
            for pdl in (False, True):
                launch = dict(launch_pdl=True) if pdl else {}
                def chain(l, P=P, pdl=pdl, launch=launch):
                    for _ in range(phases):
                        _empty_kernel[(P,)](flag, pdl, **launch)
                rec_launch = self.run("empty_launches", chain, programs=P, phases=phases, pdl=pdl)
                if rec and rec_launch:
                    self.log(f"  {P} programs: {rec['us']['median'] / phases:.2f} us a barrier, "
                             f"{rec_launch['us']['median'] / phases:.2f} us a launch (pdl={pdl})")
        if status.item():
            raise RuntimeError("a grid barrier gave up waiting")

    def projection_sweep(self, rows=(1, 9), models: tuple[str, ...] = (),
                         forms: tuple[str, ...] = ("default", "gemv", "dot", "swap"),
                         names: tuple[str, ...] = (), tilings: list[dict] | None = None) -> None:
        """The fused projections' tilings (kernels/triton_projection.py) against the default
        path, fla's separate norm / SwiGLU kernel then cuBLAS, per layer in bf16, at the
        embedded model's widths and the GDN-1.3B shape's. A tiling whose output leaves the
        reference's is recorded as an error, not timed; `forms` (`tiling_form`) limits the
        tilings timed and `names` the projections (by a word of their name: out, down);
        `tilings`, where given, are timed (with the default) instead of the sweep's own."""
        from kernels import triton_projection as tp
        from specla.graphs.ops import FlaOps

        fla = FlaOps()
        for model, config in projection_models().items():
            if models and model not in models:
                continue
            for proj, (prologue, K, N) in projection_shapes(config).items():
                if names and not any(n in proj.split() for n in names):
                    continue
                for M in rows:
                    inputs = [projection_inputs(prologue, M, K, N, config, self.dev, seed=l)
                              for l in range(self.layers)]
                    info = dict(model=model, projection=proj, M=M, K=K, N=N)
                    self.run("projection_unfused", lambda l, i=inputs: project(fla, prologue, i[l]), **info)
                    want = project(fla, prologue, inputs[0])
                    head = config.head_v_dim if prologue == "gated_norm" else 0
                    picked = tp.picked_tiling(M, N, K, torch.bfloat16, head, self.dev)
                    quick = self.replays < 40
                    timed = ([{}] + tilings if tilings is not None else
                             projection_tilings(prologue, K, quick, M, head) + swapped_tilings(K, quick, head))
                    for blocks in (b for b in timed if tiling_form(b) in forms):
                        err = self.projection_error("projection_fused", prologue, inputs[0], want,
                                                    {**info, **blocks}, **blocks)
                        if err is None:
                            continue
                        rec = self.run("projection_fused",
                                       lambda l, i=inputs, b=blocks: project(tp, prologue, i[l], **b),
                                       **info, **(blocks or {"default": picked}), rel_err=err)
                        if rec is not None:
                            rec["weight_GBps"] = N * K * 2 / (rec["us"]["median"] * 1e3)

    def projection_error(self, name: str, prologue: str, inputs: dict, want: torch.Tensor, info: dict,
                         **blocks) -> float | None:
        """Max relative error of the fused projection with tiling `blocks` against `want`, or
        None, with the reason recorded, when it fails (out of shared memory, say) or leaves
        the reference by more than 2e-2."""
        from kernels import triton_projection as tp
        try:
            got = project(tp, prologue, inputs, **blocks)
        except Exception as exc:  # noqa: BLE001 - record, go on
            self.errors.append({"name": name, **info, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            self.log(f"FAILED {name} {info}: {type(exc).__name__}")
            return None
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        if err > 2e-2:
            self.errors.append({"name": name, **info, "error": f"relative error {err:.3g} against the reference"})
            return None
        return err

    def gemv_sweep(self, models: tuple[str, ...] = ()) -> None:
        """The GEMV form (one row, an AR step's projections) streaming each layer's own weights:
        the default tiling, the sum over K left to after the loop (`packed` False) and other block
        shapes (the last two: the prologue over one 256-wide K block a program, not 4-8), with
        weight GB/s beside the time, to read against the copy rate."""
        from kernels import triton_projection as tp
        variants = [{}, {"packed": False}, {"block_k": 512}, {"block_k": 1024}, {"block_n": 4}, {"block_n": 16},
                    {"split_k": 1}, *({"block_n": n, "block_k": 256, "split_k": 8} for n in (8, 16, 32)),
                    {"block_n": 16, "block_k": 512, "split_k": 4}, {"block_n": 8, "block_k": 512, "split_k": 4}]
        for model, config in projection_models().items():
            if models and model not in models:
                continue
            for proj, (prologue, K, N) in projection_shapes(config).items():
                head = config.head_v_dim if prologue == "gated_norm" else 0
                inputs = [projection_inputs(prologue, 1, K, N, config, self.dev, seed=l) for l in range(self.layers)]
                want = project(tp, prologue, inputs[0])
                picked = tp.picked_tiling(1, N, K, torch.bfloat16, head, self.dev)
                for blocks in variants:
                    if head and blocks.get("block_k", head) % head:
                        continue
                    info = dict(model=model, projection=proj, M=1, K=K, N=N, **(blocks or {"default": picked}))
                    err = self.projection_error("gemv", prologue, inputs[0], want, info, gemv=True, **blocks)
                    if err is None:
                        continue
                    rec = self.run("gemv", lambda l, i=inputs, b=blocks: project(tp, prologue, i[l], gemv=True, **b),
                                   **info, rel_err=err)
                    if rec is not None:
                        rec["weight_GBps"] = N * K * 2 / (rec["us"]["median"] * 1e3)
                        self.log(f"   {rec['weight_GBps']:.0f} GB/s")
                del inputs

    def cublas_shapes(self, rows=(1, 9, 17)) -> None:
        """cuBLAS on the GDN-1.3B in and up projections as the verification calls it (F.linear),
        and laid out otherwise (cuBLAS picks its tile by shape): the weight's rows padded to a
        multiple of 64 or 256, the 16 gate rows in a second call, the transposed W @ h.T."""
        from specla.config import PUBLIC_1P3B as c
        D = c.hidden_size
        for proj, N in {"in": 2 * c.key_dim + 2 * c.value_dim + 2 * c.num_heads, "up": 2 * c.mlp_size}.items():
            gen = torch.Generator(device=self.dev).manual_seed(N)
            weights = {name: [torch.randn(n, D, generator=gen, device=self.dev).to(torch.bfloat16)
                              for _ in range(self.layers)]
                       for name, n in {"N": N, "pad64": -(-N // 64) * 64, "pad256": -(-N // 256) * 256}.items()}
            main, ws = N - N % 64, weights["N"]
            for M in rows:
                h = torch.randn(M, D, device=self.dev).to(torch.bfloat16)
                forms = {name: lambda l, w=w: F.linear(h, w[l]) for name, w in weights.items()}
                forms["transposed"] = lambda l: torch.mm(ws[l], h.t())
                if main != N:
                    forms[f"split {main}+{N - main}"] = lambda l: (F.linear(h, ws[l][:main]), F.linear(h, ws[l][main:]))
                for form, call in forms.items():
                    rec = self.run("cublas", call, model="gdn-1.3b", projection=proj, M=M, K=D, form=form,
                                   N_padded=weights.get(form, ws)[0].shape[0])
                    if rec is not None:
                        rec["weight_GBps"] = N * D * 2 / (rec["us"]["median"] * 1e3)
            del weights

    def checks(self) -> list[dict]:
        """Relative error of each mode against the reference (fresh state, with pending)."""
        tv, out = self.tv, []
        for n in (16, 64):
            for topo_name, parents in (("chain", chain(n)), ("random", random_tree(n)),
                                       ("deep", deep_narrow(n))):
                x = node_inputs(n, self.dev, seed=1000 + n)
                pend = factors(4, self.dev, seed=n)
                S0 = torch.randn(B, H, K, V, device=self.dev)
                cpu = [x[k].cpu() for k in ("q", "k", "v", "g", "beta")]
                S_ref = reference.commit_ref(S0.cpu(), *(t.cpu() for t in pend))
                for mode in (("chain",) if topo_name == "chain" else ()) + ("tree", "hybrid"):
                    try:
                        S = S0.clone()
                        o, d = tv.verify(mode, *(x[k] for k in ("q", "k", "v", "g", "beta")), S,
                                         Topo(parents, self.dev), pending=pend)
                        ref = (reference.chain_verify_ref(*cpu, S_ref) if mode == "chain" else
                               reference.VERIFY_REFERENCES[mode](*cpu, S_ref, torch.tensor(parents)))
                        err = {name: float((a.cpu().double() - b.double()).norm() / b.double().norm())
                               for name, a, b in (("o", o, ref[0]), ("delta", d, ref[1]), ("state", S, S_ref))}
                        out.append({"mode": mode, "topology": topo_name, "N": n, "rel_err": err})
                    except Exception as exc:
                        out.append({"mode": mode, "topology": topo_name, "N": n,
                                    "error": f"{type(exc).__name__}: {exc}"})
                    self.log(f"check {out[-1]}")
        return out

    def kernel_resources(self) -> list[dict]:
        """Registers and spills of every compiled kernel variant (from Triton's cache)."""
        rows = []
        for module, name in ((self.tv, "_walk_kernel"), (self.tv, "_tree_gram_kernel"),
                             (self.tv, "_tree_solve_kernel"), (self.tv, "_commit_kernel"),
                             (self.baselines, "_token_step_kernel")):
            fn = getattr(module, name)
            try:
                for cache in fn.device_caches.values():
                    for kernel in cache[0].values():
                        rows.append({"kernel": name, "n_regs": kernel.n_regs,
                                     "n_spills": kernel.n_spills,
                                     "num_warps": kernel.metadata.num_warps,
                                     "shared": kernel.metadata.shared,
                                     "constants": {fn.arg_names[k[0]]: str(v) for k, v in
                                                   getattr(kernel.src, "constants", {}).items()}})
            except Exception as exc:
                rows.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}"})
        return rows


def memory_rows() -> list[dict]:
    """Bytes kept per draft node and layer: factors (k, delta, g fp32) vs a state snapshot."""
    factor = H * (K + V + 1) * 4
    dense = H * K * V * 4
    return [{"per": "node-layer", "factor_bytes": factor, "dense_snapshot_bytes": dense,
             "ratio": dense / factor},
            {"per": "node (24 layers, GDN-1.3B)", "factor_bytes": 24 * factor,
             "dense_snapshot_bytes": 24 * dense, "ratio": dense / factor,
             "note": "factors exclude the short-conv inputs the runtime also keeps"}]


# ---------------------------------------------------------------------------------------
# The auto rule for specla/costmodel.py
# ---------------------------------------------------------------------------------------

def median_of(results, name, **match) -> float | None:
    for r in results:
        if r["name"] == name and all(r.get(k) == v for k, v in match.items()):
            return r["us"]["median"]
    return None


def fit_auto_rule(results: list[dict], max_tree_nodes: int) -> dict:
    """chain_max_nodes: chains up to this size use the chain kernel (it is no slower than
    the tree kernel at every measured size up to it). hybrid_min_depth_ratio: trees with
    depth + 1 >= ratio * N use the hybrid; the threshold minimises the total time lost over
    the measured trees against always picking the faster of tree and hybrid."""
    sizes = sorted({r["N"] for r in results if r["name"] == "chain" and r.get("topology") == "chain"})
    chain_max, notes = 0, []
    for n in sizes:
        c, t = median_of(results, "chain", topology="chain", N=n), median_of(results, "tree", topology="chain", N=n)
        if c is None:
            break
        if t is not None and c > t:
            break
        chain_max = n
    if sizes and chain_max == sizes[-1]:
        notes.append(f"chain kernel no slower than the tree kernel at every measured size "
                     f"(up to {chain_max}); beyond {max_tree_nodes} the tree kernel cannot run, "
                     f"so chain_max_nodes is set to the draft limit {MAX_DRAFT_NODES}")
        chain_max = MAX_DRAFT_NODES
    trees = []
    for r in results:
        if r["name"] == "tree" and r.get("topology") in TREES:
            h = median_of(results, "hybrid", topology=r["topology"], N=r["N"])
            if h is not None:
                trees.append(((r["depth"] + 1) / r["N"], r["us"]["median"], h))
    ratio = 0.5
    if trees:
        candidates = sorted({t[0] for t in trees} | {0.0, 1.01})
        regret = lambda th: sum((h if r >= th else t) - min(t, h) for r, t, h in trees)  # noqa: E731
        ratio = min(candidates, key=lambda th: (regret(th), th))
        notes.append(f"hybrid_min_depth_ratio {ratio:.3f}: total regret {regret(ratio):.2f} us over "
                     f"{len(trees)} trees (always tree: {regret(1.01):.2f}, always hybrid: {regret(0.0):.2f})")
    return {"chain_max_nodes": int(chain_max), "hybrid_min_depth_ratio": float(round(ratio, 4)),
            "notes": notes}


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def markdown(results: list[dict], auto_rule: dict) -> str:
    def cell(name, **m):
        v = median_of(results, name, **m)
        return "-" if v is None else f"{v:.1f}"

    lines = ["### verify, us per layer (median; H=8, K=V=256, graph, state from HBM)", "",
             "| N | chain | tree | hybrid | seq replay | dense snap | tree (rand) | hybrid (rand) "
             "| seq (rand) | dense (rand) | tree (wide) | hybrid (wide) | tree (deep) | hybrid (deep) |",
             "|" + "---|" * 14]
    for n in sorted({r["N"] for r in results if r["name"] == "chain" and "block_v" not in r}):
        row = [str(n)] + [cell(m, topology="chain", N=n) for m in
                          ("chain", "tree", "hybrid", "sequential_replay", "dense_snapshot")]
        row += [cell(m, topology="random", N=n) for m in ("tree", "hybrid", "sequential_replay", "dense_snapshot")]
        row += [cell(m, topology=t, N=n) for t in ("wide", "deep") for m in ("tree", "hybrid")]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "### commit, us per layer", "", "| T | factor commit | token replay | speedup |",
              "|---|---|---|---|"]
    for t in sorted({r["T"] for r in results if r["name"] == "factor_commit"}):
        f, r = median_of(results, "factor_commit", T=t), median_of(results, "token_replay", T=t)
        sp = f"{r / f:.2f}x" if f and r else "-"
        lines.append(f"| {t} | {cell('factor_commit', T=t)} | {cell('token_replay', T=t)} | {sp} |")
    lines += ["", "### deferred (fused fold + verify) vs immediate (commit, then verify), P=4", "",
              "| mode | topology | N | deferred | immediate | speedup |", "|---|---|---|---|---|---|"]
    for r in results:
        if r["name"] == "deferred":
            m = dict(mode=r["mode"], topology=r["topology"], N=r["N"])
            i = median_of(results, "immediate", **m)
            sp = f"{i / r['us']['median']:.2f}x" if i else "-"
            lines.append(f"| {r['mode']} | {r['topology']} | {r['N']} | {r['us']['median']:.1f} "
                         f"| {cell('immediate', **m)} | {sp} |")
    sweep = [r for r in results if r["name"] == "chain_sweep"]
    if sweep:
        lines += ["", "### chain kernel tiles with a pending commit folded in (best per model and N)", ""]
        for model, n in sorted({(r.get("model", "gdn-1.3b"), r["N"]) for r in sweep}):
            rows = [r for r in sweep if r.get("model", "gdn-1.3b") == model and r["N"] == n]
            best = min(rows, key=lambda r: r["us"]["median"])
            lines.append(f"- {model} N={n} P={best.get('P', 0)}: block_v={best['block_v']} "
                         f"num_warps={best['num_warps']} v_first={best.get('v_first', False)} "
                         f"{best['us']['median']:.1f} us (default: "
                         f"{cell('chain_sweep_default', model=model, N=n)} us)")
    lines += ["", f"auto_rule: chain_max_nodes={auto_rule['chain_max_nodes']}, "
                  f"hybrid_min_depth_ratio={auto_rule['hybrid_min_depth_ratio']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the JSON files")
    parser.add_argument("--layers", type=int, default=48,
                        help="distinct layer states rotated in each graph (48 x 2 MiB > L2)")
    parser.add_argument("--quick", action="store_true", help="fewer replays (a smoke run)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: "
                        "checks,verify,sweep,parallel,commit,deferred,projection,pdl,barrier,gemv,cublas")
    parser.add_argument("--only", default="", help="comma list of the only sections to run")
    parser.add_argument("--projection-rows", default="1,9",
                        help="comma list of row counts the projection sweep times")
    parser.add_argument("--projection-forms", default="default,gemv,dot,swap",
                        help="comma list of the projection sweep's tiling forms (default, gemv, dot, swap)")
    parser.add_argument("--projection-models", default="",
                        help="comma list of the projection sweep's models (embedded, gdn-1.3b; all if empty)")
    parser.add_argument("--projection-tilings", type=json.loads, default=None,
                        help="JSON list of tilings (keyword dicts) the projection sweep times beside the default")
    parser.add_argument("--projection-names", default="",
                        help="comma list of words naming the projections swept (in, up, out, down; all if empty)")
    parser.add_argument("--parallel-configs", type=json.loads, default=None,
                        help="JSON list of keyword dicts of verify() the parallel sweep times at every "
                             "size and topology (replacing its default tilings)")
    parser.add_argument("--parallel-models", default="",
                        help="comma list of the parallel sweep's shapes (embedded, gdn-1.3b; all if empty)")
    parser.add_argument("--parallel-sizes", default="4,9,16", help="comma list of the parallel sweep's node counts")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    bench = Bench(args)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "B": B, "H": H, "K": K, "V": V,
            "layers_per_graph": args.layers, "repeats": bench.repeats, "replays": bench.replays,
            "unit": "microseconds per layer (one graph replay / layers)",
            "state_bytes_per_layer": B * H * K * V * 4}
    try:
        meta["copy_GBps"] = copy_bandwidth(bench.dev)
        meta["state_read_floor_us"] = meta["state_bytes_per_layer"] / (meta["copy_GBps"]["median"] * 1e3)
        bench.log(f"device copy {meta['copy_GBps']['median']:.0f} GB/s; reading one layer's state "
                  f"takes >= {meta['state_read_floor_us']:.2f} us")
    except Exception as exc:
        meta["copy_GBps_error"] = str(exc)
    sections = [("checks", lambda: meta.__setitem__("checks", bench.checks())),
                ("verify", lambda: bench.verify_variants(SIZES + (128,))),
                ("commit", bench.commit_variants),
                ("deferred", bench.deferred_variants),
                ("sweep", bench.walk_sweep),
                ("parallel", lambda: bench.parallel_sweep(
                    tuple(int(n) for n in args.parallel_sizes.split(",")), configs=args.parallel_configs,
                    models=tuple(filter(None, args.parallel_models.split(","))))),
                ("pdl", bench.pdl_chain),
                ("barrier", bench.barrier_cost),
                ("cublas", bench.cublas_shapes),
                ("gemv", lambda: bench.gemv_sweep(tuple(filter(None, args.projection_models.split(","))))),
                ("projection", lambda: bench.projection_sweep(
                    tuple(int(r) for r in args.projection_rows.split(",")),
                    tuple(filter(None, args.projection_models.split(","))),
                    tuple(filter(None, args.projection_forms.split(","))),
                    tuple(filter(None, args.projection_names.split(","))), args.projection_tilings))]
    def save() -> dict:
        """Both files, rewritten after every section: a timeout loses only the running one."""
        auto_rule = fit_auto_rule(bench.results, bench.tv.MAX_TREE_NODES)
        report = {"meta": meta, "results": bench.results, "memory": memory_rows(),
                  "kernels": bench.kernel_resources(), "errors": bench.errors}
        (args.out / "kernels.json").write_text(json.dumps(report, indent=1))
        cost = {"auto_rule": {k: auto_rule[k] for k in ("chain_max_nodes", "hybrid_min_depth_ratio")},
                "notes": auto_rule["notes"], "meta": meta,
                "timings": [{k: r[k] for k in ("name", "topology", "N", "depth", "us") if k in r}
                            for r in bench.results if r["name"] in ("chain", "tree", "hybrid")]}
        (args.out / "verify_cost.json").write_text(json.dumps(cost, indent=1))
        return auto_rule

    auto_rule = save()
    for name, section in sections:
        if name in skip or (args.only and name not in args.only.split(",")):
            continue
        bench.log(f"== {name}")
        try:
            section()
        except Exception as exc:
            bench.errors.append({"section": name, "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc(limit=6)})
            bench.log(f"section {name} FAILED: {exc}")
        auto_rule = save()
    bench.log(f"wrote {args.out / 'kernels.json'} and {args.out / 'verify_cost.json'}; "
              f"{len(bench.results)} timings, {len(bench.errors)} errors")
    mem = memory_rows()[0]
    print(f"\nmemory per node and layer: factors {mem['factor_bytes']} B vs dense snapshot "
          f"{mem['dense_snapshot_bytes']} B ({mem['ratio']:.0f}x)")
    for e in bench.errors:
        print(f"ERROR {e.get('name', e.get('section'))}: {e['error'][:200]}")
    print()
    print(markdown(bench.results, auto_rule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
