"""Where one dependent phase of a persistent step goes, 1 row against 16.

    python benchmarks/phase_anatomy.py --out DIR [--phases 60] [--variants gemv/1/512/4,dot/16/256/4]

Why: at the embedded shape a 16-row phase of the verification costs 3.3-5.6 µs, an AR
step's 1-row phase about 2.6, though both read the same weights (h100/session41/). This
kernel chains `--phases` copies of one phase, the verification's gate/up projection
(residual add + RMSNorm + a 2048 x 384 bf16 matrix in 16-column units, 128 units for
132 programs), joined by the grid barrier the product's kernels use, and stamps the GPU's
global timer in each unit (in a launch of its own: each stamp costs a reduction): after
the barrier, after the norm's mean square, after the products, at the end. A variant is form/rows/block_k/warps:

    gemv  the AR step's form (`_gemv_slice`: one row, packed FMA sums); stamps at the end only
    dot   the verification's form (`_dot_slice`'s steps: tl.dot on a 16-row tile)

Writes phase_anatomy.json: per variant µs a phase (median of launches over the launch's
phases) and the median unit's µs from the barrier to each stamp.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_verify_step import time_us  # noqa: E402
from kernels.pdl import grid_arrive, grid_wait  # noqa: E402
from kernels.triton_projection import _dot, _dot_mode, _gemv_slice, _input_block, _row_rstd  # noqa: E402

STAMPS = ("barrier", "mean square", "products", "end")
D, N = 384, 2048          # the embedded model's gate/up projection


@triton.jit
def _stamp_after(times, idx, dep):
    """The global timer, read once `dep` (a scalar) has been computed, into times[idx]."""
    now = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.f32 p, $1, 0f7F800001; @p mov.u64 $0, 0; @!p mov.u64 $0, %globaltimer; }",
        "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(times + idx, now)


@triton.jit
def _anatomy_kernel(x_a, x_b, res, res_out, norm_w, w, counter, status, times, M, eps, PHASES: tl.constexpr,
                    K: tl.constexpr, N: tl.constexpr, GEMV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, DOT: tl.constexpr, STAMPED: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = w.dtype.element_ty
    rows = tl.arange(0, BM)
    r_mask = rows < M
    offs = tl.arange(0, BK)
    blocks = tl.cdiv(N, BN)
    for p in range(PHASES):
        # ping-pong: this phase's input is the first K columns of the last one's output
        if p % 2 == 0:
            src_x, dst = x_a, x_b
        else:
            src_x, dst = x_b, x_a
        src = (src_x, N, res, K, res_out, res, 0, norm_w)
        arrivals = p * programs
        base = p * 4 * programs + pid
        for blk in range(pid, blocks, programs):
            cols = blk * BN + tl.arange(0, BN)
            c_mask = cols < N
            w_rows = w + cols[:, None] * K
            if GEMV:
                acc = _gemv_slice(src, w_rows, c_mask, 0, K, M, K, eps, blk == 0, dtype, 0, True, True, 1,
                                  BM, BN, BK, 2, 8, (counter, tl.where(blk == pid, arrivals, 0), status))
            else:   # _dot_slice's WAIT 2 steps, stamped
                wb = tl.load(w_rows + offs[None, :], mask=c_mask[:, None] & (offs < K)[None, :], other=0.0)
                if blk == pid:
                    grid_wait(counter, arrivals, status)
                if STAMPED:
                    _stamp_after(times, base, 1.0)
                rstd = _row_rstd(src, rows, r_mask, K, eps, True, BM, BK)
                if STAMPED:
                    _stamp_after(times, base + programs, tl.sum(rstd, axis=0))
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                for k0 in range(0, K, BK):
                    ks = k0 + offs
                    h = _input_block(src, rstd, eps, rows, r_mask, ks, ks < K, K, blk == 0, dtype, 0, True, True, 1,
                                     BM, BK)
                    nks = ks + BK
                    w_next = tl.load(w_rows + nks[None, :], mask=c_mask[:, None] & (nks < K)[None, :], other=0.0)
                    acc += _dot(h, wb, DOT)
                    wb = w_next
                if STAMPED:
                    _stamp_after(times, base + 2 * programs, tl.sum(tl.sum(acc, axis=1), axis=0))
            out_mask = r_mask[:, None] & c_mask[None, :]
            tl.store(dst + rows[:, None] * N + cols[None, :], acc.to(dtype), mask=out_mask)
        if pid >= blocks:
            grid_wait(counter, arrivals, status)
        _stamp_after(times, base + 3 * programs, 1.0)
        grid_arrive(counter)
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if last == (PHASES + 1) * programs - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def run_variant(form: str, rows: int, block_k: int, warps: int, phases: int, launches: int = 15) -> dict:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *shape: (torch.randn(*shape, device=dev, generator=gen) * 0.5).to(dtype)  # noqa: E731
    x_a, x_b, res, res_out = mk(16, N), mk(16, N), mk(16, D), mk(16, D)
    norm_w, w = mk(D) + 1, mk(N, D) * 0.05
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    status = torch.zeros(1, device=dev, dtype=torch.int32)
    times = torch.zeros(phases * 4 * programs, device=dev, dtype=torch.int64)
    gemv = form == "gemv"
    if gemv and rows > 2:
        raise ValueError("the GEMV form takes one or two rows")
    meta = dict(PHASES=phases, K=D, N=N, GEMV=gemv, BM=(rows if gemv else 16), BN=16, BK=block_k,
                DOT=_dot_mode(dtype), num_warps=warps, num_stages=1)   # as the verification launches
    launch = lambda stamped=False: _anatomy_kernel[(programs,)](  # noqa: E731
        x_a, x_b, res, res_out, norm_w, w, counter, status, times, rows, 1e-6, STAMPED=stamped, **meta)
    row = {"us_per_phase": round(time_us(launch, inner=1, repeats=launches) / phases, 3)}
    launch(stamped=not gemv)    # the unit stamps cost a reduction each: a launch of their own
    torch.cuda.synchronize()
    row["failed"] = bool(status.item())
    t = times.view(phases, 4, programs).double().cpu() / 1e3
    ends = t[:, 3].max(dim=1).values
    units = (N + 15) // 16
    if not gemv:    # each unit-holding program's steps, from the previous phase's last end
        steps = {name: [] for name in STAMPS}
        for p in range(1, phases):
            for s, name in enumerate(STAMPS):
                steps[name] += (t[p, s, :units] - ends[p - 1]).tolist()
        row["unit_us_from_previous_phase_end"] = {k: round(statistics.median(v), 3) for k, v in steps.items()}
    idle = (t[1:, 3, units:] - ends[:-1, None]).flatten().tolist()
    row["idle_program_end_us"] = round(statistics.median(idle), 3) if idle else None
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--phases", type=int, default=60)
    p.add_argument("--variants", default="gemv/1/512/4,dot/1/256/4,dot/16/256/4,dot/16/512/4,dot/16/512/8,"
                                         "dot/16/128/4,dot/16/64/4")
    args = p.parse_args(argv)
    result = {"command": " ".join(["python benchmarks/phase_anatomy.py"] + (argv or sys.argv[1:])),
              "commit": os.environ.get("SPECLA_COMMIT"), "device": torch.cuda.get_device_name(),
              "matrix": [N, D], "units": (N + 15) // 16, "stamps": STAMPS, "variants": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        form, rows, block_k, warps = variant.split("/")
        try:
            row = run_variant(form, int(rows), int(block_k), int(warps), args.phases)
        except Exception as err:  # noqa: BLE001 - a variant that does not compile is a result too
            row = {"error": f"{type(err).__name__}: {err}"[:400]}
        result["variants"][variant] = row
        print(variant, json.dumps(row), flush=True)
        (args.out / "phase_anatomy.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
