"""Instructions, registers and spills of the fused LiLiCorr head's launches for an H100 /
H200 (sm_90), on a machine without a GPU:

    python benchmarks/ptxas_check.py [--top-k 4 8] [--shape embedded gdn-1.3b]
        [--kernels head verify persistent tree]

Each launch of `FusedLiLiCorrHead.draft` is recorded instead of run and compiled by Triton
for sm_90 (`--kernels verify`: the verification's state kernels instead, the parallel form
and the persistent verify step; `--kernels persistent`: the embedded pair's three persistent
kernels, with the shared memory each program asks for, which sets the L1 / shared split the
driver gives each; `--kernels tree`: the best-first draft tree as a launch of its own). The
ptxas that ships with Triton assembles its PTX and reports the registers a thread uses and
the bytes it spills; Triton's cuobjdump lists the machine code. The head
program's H200 times have tracked these counts (benchmarks/results/h200/README.md, sessions
5 and 6), so a change can be checked here before it costs device time.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.triton_lilicorr as fused_head  # noqa: E402
from benchmarks.bench_lilicorr import SHAPES, SLOTS  # noqa: E402
from specla.drafters.lilicorr import HeadConfig, LiLiCorrHead  # noqa: E402

POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32", torch.uint8: "*u8"}
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTXAS, CUOBJDUMP = NVIDIA_BIN / "ptxas", NVIDIA_BIN / "cuobjdump"


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.calls.append((self.kernel, args, kwargs))
            return None
        return record


def recorded_launches(call, names: list[str], module=fused_head) -> list:
    """Run `call()` with the module-level kernels `names` of `module` recording their
    launches -> [(kernel, args, kwargs)]."""
    calls: list = []
    originals = {name: getattr(module, name) for name in names}
    try:
        for name, kernel in originals.items():
            setattr(module, name, _Recorder(kernel, calls))
        call()
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)
    return calls


def compile_sm90(kernel, args: tuple, kwargs: dict):
    """Compile one recorded launch for sm_90 -> Triton's CompiledKernel (PTX in .asm["ptx"]),
    specialised as Triton's launcher would: pointers and integers divisible by 16 marked so
    (else no vector loads), integers equal to 1 made constants."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    constexprs = {k: v for k, v in kwargs.items() if k not in options}
    names = kernel.arg_names
    # constexprs the launch left at their defaults (PDL off without a GPU)
    constexprs.update({p.name: p.default for p in kernel.params[len(args):]
                       if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty})
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[name], aligned = "fp32", False
        elif value == 1:
            signature[name], aligned = "constexpr", False
            constexprs[name] = 1
        else:
            signature[name], aligned = "i32", value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options)


def ptxas_usage(ptx: str) -> dict:
    """ptxas -v on the PTX -> registers a thread and spill bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        proc = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(path), "-o", os.devnull],
                              capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if proc.returncode or not (regs and spills):
        raise RuntimeError(f"ptxas failed: {text[-500:]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


def sass_instructions(cubin: bytes) -> int:
    """The number of machine instructions in a compiled kernel (cuobjdump -sass). The head
    program runs most of them once, so inside a decoding step, where the target's weights
    have evicted its code from L2, each one is fetched cold."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True).stdout
    return sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/\s+\S.*;", line))


def head_launches(fields: dict, top_k: int, slots: int = SLOTS, vocab: int = 32000, **options) -> list:
    """The two launches of `draft` for a bf16 head of `fields` over a slots x top_k lattice."""
    head = LiLiCorrHead(HeadConfig(**fields)).to(torch.bfloat16)
    fused = fused_head.FusedLiLiCorrHead(head, slots, top_k, torch.zeros(vocab, fields["target_hidden"]), **options)
    logits = torch.zeros(1, slots, vocab)
    hidden, anchor = torch.zeros(1, slots, fields["drafter_width"]), torch.zeros(1, fields["drafter_width"])
    return recorded_launches(lambda: fused.draft(logits, hidden, anchor),
                             ["_head_prologue_kernel", "_lilicorr_head_kernel"])


def verify_launches(pending: int = 8) -> list[tuple[str, tuple]]:
    """(case, launch) for the state kernels of a verification, at the GDN-1.3B head shape
    (8 x 256 x 256) and the embedded model's (6 x 64 x 64)."""
    from kernels import triton_verify, triton_verify_step
    from benchmarks.bench_verify_step import accept_buffers
    from tests.test_decode_step import SHAPES as STEP_SHAPES, random_weights

    z, out = torch.zeros, []
    # the parallel form's default, and at the 1.3B shape its other orders and product precisions
    forms = {(8, 256, 9): ({}, {"gram_first": True}, {"dot_precision": "tf32x3"},
                           {"gram_first": True, "dot_precision": "tf32x3"}), (6, 64, 16): ({},)}
    for (H, K, N), options in forms.items():
        x = [z(1, N, H, K) for _ in range(3)] + [z(1, N, H), z(1, N, H), z(1, H, K, K)]
        pend = (z(1, pending, H, K), z(1, pending, H, K), z(1, pending, H))
        for option in options:
            launch = recorded_launches(lambda: triton_verify._parallel_verify(
                *x, torch.arange(-1, N - 1), True, pend, z(1, N, H, K), z(1, N, H, K), **option),
                ["_parallel_kernel"], triton_verify)[0]
            launch[2]["PREFETCH_STATE"] = launch[2]["GRAM_FIRST"]      # as on an sm_90 device
            out.append((" ".join([f"K={K} N={N} P={pending}"] + [f"{k}={v}" for k, v in option.items()]), launch))
    L, D, H, K, V, W, I, vocab = STEP_SHAPES["embedded"]
    wt = random_weights(L, D, H, K, V, W, I, vocab, torch.bfloat16, "cpu", False, 0)
    n, C = 16, H * (2 * K + V)
    factors = (z(L, 1, n, H, K), z(L, 1, n, H), z(L, 1, n, H, V), z(L, 1, n, C, dtype=torch.bfloat16))
    pend = (z(L, 1, pending, H, K), z(L, 1, pending, H, V), z(L, 1, pending, H))
    verify = triton_verify_step.PersistentChainVerify(wt, H, K, V, 1e-6, n, (1, 3, L - 1), programs=132)
    args = (torch.randint(2, vocab, (1, n)), torch.ones(1, dtype=torch.long), z(L, 1, C, W, dtype=torch.bfloat16),
            z(L, 1, H, K, V), pend, z(n, vocab), z(n, D, dtype=torch.bfloat16),
            z(n, 3, D, dtype=torch.bfloat16), factors)
    launch = recorded_launches(lambda: verify(*args, accept=accept_buffers(n, pending, "cpu")),
                               ["_chain_verify_kernel"], triton_verify_step)[0]
    out.append((f"embedded N={n} P={pending} accept", launch))
    return out


def persistent_launches() -> list[tuple[str, tuple]]:
    """(case, launch) for the three persistent kernels of the embedded pair's speculative step
    in bf16, as a GPU runs them: the AR step, the 16-node verification with acceptance (random
    weights of the embedded shape) and the block drafter's draft (assets/, on the CPU), also
    growing a best-first tree in the launch."""
    from kernels import triton_decode_step, triton_draft_step
    from specla import runner
    from specla.drafters.base import DraftSettings
    from specla.graphs.draft_step import check_block_draft, draft_weights
    from specla.graphs.drafters import DeviceBlockDrafter
    from tests.test_decode_step import SHAPES as STEP_SHAPES, random_weights

    L, D, H, K, V, W, I, vocab = STEP_SHAPES["embedded"]
    wt = random_weights(L, D, H, K, V, W, I, vocab, torch.bfloat16, "cpu", False, 0)
    step = triton_decode_step.PersistentDecodeStep(wt, H, K, V, 1e-6, programs=132)
    token, z = torch.tensor([[3]]), torch.zeros
    args = (token, z(L, 1, H * (2 * K + V), W, dtype=torch.bfloat16), z(L, 1, H, K, V), z(vocab))
    greedy = (token, z(8, dtype=torch.long), z(1, dtype=torch.long))
    out = [("embedded AR step", recorded_launches(lambda: step(*args, greedy=greedy), ["_decode_step_kernel"],
                                                  triton_decode_step)[0])]
    out += [(case, launch) for case, launch in verify_launches() if case.startswith("embedded")]
    drafter = runner.load_runtime(device="cpu", dtype="bf16").drafters.get("block")
    if drafter is not None:
        c = drafter.net.config
        dev = DeviceBlockDrafter(drafter, DraftSettings(tree="chain", block_size=c.block_size, top_k=4,
                                                        budget=c.block_size - 1), persistent=False)
        kernel = triton_draft_step.PersistentBlockDraft(draft_weights(dev.net, dev.parts), c.heads, c.window,
                                                        c.block_size, dev.slots, dev.top_k, dev.net.norm.eps,
                                                        dev.parts.norm_eps, programs=132)
        out.append(("block draft (assets/)", recorded_launches(lambda: check_block_draft(dev, kernel),
                                                               ["_block_draft_kernel"], triton_draft_step)[0]))
        # the same draft growing a best-first tree of 16 nodes over top-8 candidates in the launch
        S, k, n, z = dev.slots, 8, 16, torch.zeros
        tree_kernel = triton_draft_step.PersistentBlockDraft(
            draft_weights(dev.net, dev.parts), c.heads, c.window, c.block_size, S, k, dev.net.norm.eps,
            dev.parts.norm_eps, programs=132)
        long = dict(dtype=torch.long)
        tree = triton_draft_step.TreeOut(z(n, **long), z(n, **long), z(n, 4, **long), z(1, **long), z(4, S, k, **long),
                                         z(4, S, k), z(4, n))
        args = (z(1, **long), torch.tensor([-1, 0, 0] + [0] * c.block_size), None, dev.ctx, dev.valid, dev.kv_stack,
                z(c.block_size - 1, c.width, dtype=torch.bfloat16), z(c.block_size - 1, dev.parts.vocab_size),
                z(S, k, **long), z(S, k))
        out.append(("block draft, best-first tree of 16 (assets/)", recorded_launches(
            lambda: tree_kernel(*args, tree), ["_block_draft_kernel"], triton_draft_step)[0]))
    return out


def tree_launches() -> list[tuple[str, tuple]]:
    """(case, launch) of `best_first_tree` as a launch of its own, 16 nodes of top-8 over 7
    slots: the block drafter's static rows and LiLiCorr's conditional ones."""
    from kernels import triton_draft_step
    out, long = [], dict(dtype=torch.long)
    for name, rows in (("static rows (block)", torch.zeros(7, 8)), ("conditional rows (LiLiCorr)", torch.zeros(7, 8, 8))):
        launch = recorded_launches(lambda: triton_draft_step.best_first_tree(torch.zeros(7, 8, **long), rows, 16, 4),
                                   ["_best_first_tree_kernel"], triton_draft_step)[0]
        out.append((f"best-first tree of 16, {name}", launch))
    return out


def launch_report(launch: tuple) -> dict:
    """One recorded launch -> its name, sm_90 instructions, registers, spill bytes, shared
    memory bytes a program and warps."""
    kernel, call_args, kwargs = launch
    compiled = compile_sm90(kernel, call_args, kwargs)
    return {"launch": kernel.__name__, "instructions": sass_instructions(compiled.asm["cubin"]),
            **ptxas_usage(compiled.asm["ptx"]), "shared_bytes": compiled.metadata.shared,
            "warps": compiled.metadata.num_warps}


COLUMNS = {"instructions": "instructions", "registers": "registers", "spill_stores": "spill stores (bytes)",
           "spill_loads": "spill loads (bytes)", "shared_bytes": "shared bytes", "warps": "warps"}


def print_reports(cases: list[tuple[str, tuple]], columns: tuple[str, ...]) -> None:
    """A Markdown table of `launch_report`'s `columns` for each (case, launch)."""
    print("| launch | case | " + " | ".join(COLUMNS[c] for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for case, launch in cases:
        r = launch_report(launch)
        print(f"| {r['launch']} | {case} | " + " | ".join(str(r[c]) for c in columns) + " |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top-k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--num-warps", type=int, default=8)
    parser.add_argument("--kernels", nargs="+", default=["head"], choices=["head", "verify", "persistent", "tree"])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles the kernels")
    if "verify" in args.kernels:
        print_reports(verify_launches(), ("instructions", "registers", "spill_stores", "spill_loads"))
    if "persistent" in args.kernels:
        print_reports(persistent_launches(), ("shared_bytes", "warps", "registers", "instructions", "spill_stores",
                                              "spill_loads"))
    if "tree" in args.kernels:
        print_reports(tree_launches(), ("warps", "registers", "instructions", "spill_stores", "spill_loads"))
    if "head" not in args.kernels:
        return 0
    print("| shape | top-k | launch | instructions | registers | spill stores (bytes) | spill loads (bytes) |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shape:
        for top_k in args.top_k:
            launches = head_launches(SHAPES[shape], top_k, num_warps=args.num_warps)
            for launch in launches:
                r = launch_report(launch)
                print(f"| {shape} | {top_k} | {r['launch']} | {r['instructions']} | {r['registers']} | "
                      f"{r['spill_stores']} | {r['spill_loads']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
