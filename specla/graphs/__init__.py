"""The CUDA-graph backend: the AR baseline and the speculative step as captured graphs.

Eager PyTorch spends far more time launching kernels than a decode step needs on the GPU,
so both sides of every speedup run here as graphs over static buffers allocated once:

    ops.py       per-layer ops (plain torch, or fla's fused kernels + ours) and packed weights
    runtime.py   `PackedTarget` (the target packed for decoding, its AR and tree forwards),
                 `StaticState`, graph capture and event timing
    ar.py        `GraphedAR`: one token per replay
    spec.py      `GraphedSpec`: verify, accept, commit and draft as graphs for one topology
    buckets.py   drafts padded to a few sizes so that similar drafts share a graph
    drafters.py  device-resident drafters that run inside the step graph
    oracle.py    the oracle drafter as tensor ops (measurement)
    decoders.py  decode loops over the graphed step

Every body also runs eagerly (`use_graph=False`), on the CPU too: the tests check the logic
there, and a failed capture can fall back to it. `specla.engine` is the API above this.
"""
