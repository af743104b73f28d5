"""The public checkpoint shapes parse exactly, and the CLI gives clear errors, not tracebacks."""
import json
import sys
from pathlib import Path

import pytest
import torch

from specla import cli
from specla.config import FLA_DEFAULT, GDNConfig, ModelFormatError
from specla.model import GDNForCausalLM

MAP_1P3B_CONFIG = {  # the fields of m-a-p's 1.3B-100B GatedDeltaNet-pure config.json that matter
    "model_type": "gated_deltanet", "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 8,
    "head_dim": 256, "expand_v": 1, "intermediate_size": 5632, "vocab_size": 32000,
    "tie_word_embeddings": False, "use_gate": True, "use_short_conv": True, "conv_size": 4,
    "attn_mode": "chunk", "hidden_act": "swish", "norm_eps": 1e-06, "fuse_cross_entropy": True,
}


def parameter_count(config: GDNConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GDNForCausalLM(config).parameters())


def test_public_1p3b_shape_has_the_published_parameter_count():
    config = GDNConfig.from_dict(MAP_1P3B_CONFIG)
    assert parameter_count(config) == 1_466_343_808
    assert config.state_bytes() == 48 * 2**20          # 24 layers x 8 heads x 256 x 256 x 4 bytes of fp32 state


def test_fla_default_shape():
    assert round(parameter_count(FLA_DEFAULT) / 1e6) == 1387


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "model_type"),
    ({"num_v_heads": 16}, "grouped value heads"),
    ({"use_short_conv": False}, "use_short_conv"),
    ({"hidden_size": -1}, "hidden_size"),
])
def test_unsupported_configs_are_refused_clearly(change, message):
    with pytest.raises(ModelFormatError, match=message):
        GDNConfig.from_dict({**MAP_1P3B_CONFIG, **change})


def run_cli(args, capsys):
    code = cli.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_last_line(capsys):
    code, out, _ = run_cli(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8",
                            "--device", "cpu", "--json"], capsys)
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 8 and result["device"] == "cpu" and result["tokens_per_s"] > 0


@pytest.mark.skipif(not (cli.DEFAULT_DRAFTERS / "block" / "drafter.json").exists(), reason="needs the block drafter")
def test_generate_with_the_measured_preset_equals_ar(capsys):
    """--preset measured drafts the block drafter's measured tree (as the page's preset box does),
    and the text is AR's token for token (fp32 on the CPU)."""
    prompt = ["--prompt", "def add(a, b):", "--max-new-tokens", "24", "--device", "cpu", "--json"]
    code, out, _ = run_cli(["generate", *prompt], capsys)
    assert code == 0
    ar = json.loads(out.strip().splitlines()[-1])
    code, out, err = run_cli(["generate", *prompt, "--drafter", "block", "--preset", "measured"], capsys)
    assert code == 0, err
    spec = json.loads(out.strip().splitlines()[-1])
    assert spec["token_ids"] == ar["token_ids"] and spec["target_forwards"] < len(ar["token_ids"])


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", ""], "prompt is empty"),
    (["generate", "--prompt", "x " * 9000], "limit"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/folder"], "no such checkpoint folder"),
    (["acceptance", "--prompts", "/nonexistent.jsonl", "--drafter", "block"], "cannot read prompts"),
    (["acceptance", "--prompts", "examples/prompts.jsonl", "--top-k", "0"], "top-k"),
    (["generate", "--prompt", "x", "--drafter", "lilicorr", "--preset", "measured"], "has no measured tree preset"),
    (["generate", "--prompt", "x", "--drafter", "block", "--preset", "[[1], [0]"], "not a JSON list"),
    (["exactness", "--prompts", "examples/prompts.jsonl", "--preset", "measured"], "the oracle drafts one chain"),
], ids=["empty-prompt", "long-prompt", "max-new-tokens", "missing-model", "missing-prompts", "top-k",
        "no-measured-preset", "bad-preset", "oracle-preset"])
def test_bad_input_is_a_one_line_error(args, message, capsys):
    code, _, err = run_cli(args + ["--device", "cpu"], capsys)
    assert code == 2
    assert err.startswith("error:") and message in err


def test_fused_projections_route_by_rows_and_matrix_size():
    """FusedOps fuses one or two rows at any width, several rows only for small matrices (the
    embedded model's), and never more rows than its kernel holds."""
    from specla.graphs.ops import MAX_DOT_WEIGHTS, fused_projection_fits

    embedded_up, gdn_1p3b_in, gdn_1p3b_out = 2048 * 384, 8208 * 2048, 2048 * 2048
    assert embedded_up < MAX_DOT_WEIGHTS < gdn_1p3b_in
    assert not fused_projection_fits(17, gdn_1p3b_out, 64, 2)     # a tree of 16: cuBLAS
    assert fused_projection_fits(1, gdn_1p3b_in, 64, 2)
    assert fused_projection_fits(2, gdn_1p3b_in, 64, 2)
    assert not fused_projection_fits(9, gdn_1p3b_in, 64, 2)
    assert fused_projection_fits(9, embedded_up, 64, 2)
    assert not fused_projection_fits(65, embedded_up, 64, 2)


def test_several_rows_of_a_large_narrow_matrix_default_to_the_swapped_form():
    """3 to 16 rows (a draft's verification) of a matrix of at least SWAP_MIN_BYTES with few
    output columns (the 1.3B shape's out and down projections) run fused in the swapped tl.dot
    form, which beat fla's kernels + cuBLAS there; the wide in and up projections, one or two
    rows, a prefill's 64 and a small matrix do not. Its pipeline stays inside the shared
    memory budget in bf16 and fp32."""
    from kernels import triton_projection as tp

    big = tp.SWAP_MIN_BYTES
    assert big is not None
    assert tp.swaps(9, 2048, 2048 * 5632 * 2) and tp.swaps(16, 2048, 2048 * 2048 * 2)
    assert not tp.swaps(9, 8208, 8208 * 2048 * 2) and not tp.swaps(2, 2048, big)
    assert not tp.swaps(64, 2048, big) and not tp.swaps(9, 2048, big - 1)
    for M, N, K, head in ((9, 2048, 2048, 256), (16, 2048, 5632, 0), (3, 1024, 4096, 0)):
        for elem in (2, 4):
            t = tp._tiling(M, N, K, elem, head, 132)
            assert t.swap and not t.gemv and t.block_n >= 64 and t.block_k % max(head, 1) == 0, t
            tile = (t.block_n + max(16, M)) * t.block_k * elem
            assert (t.num_stages - 1) * tile <= tp.SWAP_SHARED_BYTES, t
    assert not tp._tiling(9, 8208, 2048, 2, 0, 132).swap


def test_the_swapped_gated_norm_preloads_its_inputs_and_splits_k_to_single_blocks(monkeypatch):
    """The 9-row out projection (gated norm) loads its inputs a K block ahead into registers,
    one 256-wide head a slice, two stages (SWAP_PRELOAD); the SwiGLU down projection keeps
    Triton's staged inputs and slices of several K blocks; SWAP_PRELOAD off and a caller's
    preload=False give the gated norm the plain form."""
    from kernels import triton_projection as tp

    out, down = tp._tiling(9, 2048, 2048, 2, 256, 132), tp._tiling(9, 2048, 5632, 2, 0, 132)
    assert out.swap and out.preload and (out.block_k, out.split_k, out.num_stages) == (256, 8, 2), out
    assert down.swap and not down.preload and down.split_k == 8 and down.num_stages == 4, down
    plain = tp._tiling(9, 2048, 2048, 2, 256, 132, preload=False)
    assert plain.swap and not plain.preload and plain.split_k == 4
    monkeypatch.setattr(tp, "SWAP_PRELOAD", False)
    assert tp._tiling(9, 2048, 2048, 2, 256, 132) == plain
    with pytest.raises(ValueError):
        tp._tiling(1, 2048, 2048, 2, 256, 132, gemv=True, preload=True)


def test_few_blocks_tiling_sets_the_gemv_default_where_column_blocks_do_not_fill_the_gpu(monkeypatch):
    """FEW_BLOCKS_TILING (block_n, block_k, split_k) replaces the rule for a row of the
    1.3B shape's out and down projections only: whole heads stay whole, the wide in
    projection, the dot forms and a caller's own keywords keep theirs."""
    from kernels import triton_projection as tp
    rule_out, rule_in = tp._tiling(1, 2048, 2048, 2, 256, 132), tp._tiling(1, 8208, 2048, 2, 0, 132)
    monkeypatch.setattr(tp, "FEW_BLOCKS_TILING", (16, 128, 8))
    out, down = tp._tiling(1, 2048, 2048, 2, 256, 132), tp._tiling(1, 2048, 5632, 2, 0, 132)
    assert (out.block_n, out.block_k, out.split_k) == (16, 256, 8) and out.gemv
    assert (down.block_n, down.block_k) == (16, 128) and down.split_k == 8
    assert out != rule_out and tp._tiling(1, 8208, 2048, 2, 0, 132) == rule_in
    assert tp._tiling(9, 2048, 2048, 2, 256, 132).swap
    assert tp._tiling(1, 2048, 2048, 2, 256, 132, split_k=1) != out


def test_small_matrices_default_to_few_round_trips_and_large_ones_to_bandwidth():
    """The embedded model's projections are latency-bound: their default tiling has no
    split-K for a row (the whole of K in one block up to 1024 columns), no split for a wide
    matrix with a short K at 8 rows, and one K block a program otherwise. The GDN-1.3B
    shape's matrices are all over the threshold, so the bandwidth heuristic keeps them."""
    from specla.config import PUBLIC_1P3B
    from kernels.triton_projection import LATENCY_BOUND_BYTES, picked_tiling
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_kernels import projection_models, projection_shapes

    embedded = projection_models()["embedded"]
    for name, (prologue, K, N) in projection_shapes(embedded).items():
        head = embedded.head_v_dim if prologue == "gated_norm" else 0
        assert N * K * 2 <= LATENCY_BOUND_BYTES, name
        row = picked_tiling(1, N, K, torch.bfloat16, head)
        assert row["gemv"] and row["split_k"] == 1 and row["block_k"] >= min(1024, K), (name, row)
        rows8 = picked_tiling(8, N, K, torch.bfloat16, head)
        assert not rows8["gemv"], (name, rows8)
        one_block_each = rows8["split_k"] == -(-K // rows8["block_k"])
        assert rows8["split_k"] == 1 or one_block_each, (name, rows8)
    wide = projection_shapes(embedded)["in (norm)"]
    assert picked_tiling(8, wide[2], wide[1], torch.bfloat16)["split_k"] == 1
    for name, (prologue, K, N) in projection_shapes(PUBLIC_1P3B).items():
        assert N * K * 2 > LATENCY_BOUND_BYTES, name


def test_auto_ops_fuse_the_projections_up_to_the_measured_widths():
    """"auto" on CUDA: the fused projections at the embedded width and the GDN-1.3B one (both
    measured faster than fla's kernels, AR and speculation), fla's kernels past them; torch
    ops on the CPU. Device names only: no GPU needed."""
    import dataclasses

    from specla.config import PUBLIC_1P3B
    from specla.graphs.ops import auto_ops_name

    embedded = GDNConfig(vocab_size=4096, hidden_size=384, num_hidden_layers=6, num_heads=6, head_dim=64)
    assert auto_ops_name(embedded, "cuda") == "fused"
    assert auto_ops_name(PUBLIC_1P3B, "cuda") == "fused"
    assert auto_ops_name(dataclasses.replace(PUBLIC_1P3B, hidden_size=4096), "cuda") == "fla"
    assert auto_ops_name(embedded, "cpu") == auto_ops_name(PUBLIC_1P3B, "cpu") == "torch"


def test_a_kernel_that_fails_its_self_check_is_switched_off_alone(monkeypatch):
    """make_ops' self-check: each failing check turns off only its own kernel (our recurrence
    before the in-place launch of fla's), the note says so, and a failure no switch clears raises."""
    from specla.config import PUBLIC_1P3B
    from specla.graphs import ops as graph_ops

    class Stub:
        inplace_recurrent = fused_conv_gates = greedy_kernel = True
        recurrent_kernel = fused_conv_projection = True

    broken = {"recurrent_kernel": "recurrent_step", "greedy_kernel": "greedy_take"}

    def check(ops, *args):
        return [f"{name}: bad" for switch, name in broken.items() if getattr(ops, switch)]
    monkeypatch.setattr(graph_ops, "FusedOps", Stub)
    monkeypatch.setattr(graph_ops, "check_ops", check)
    ops, note = graph_ops._checked_ops("fused", PUBLIC_1P3B, "cpu", torch.bfloat16)
    assert (ops.recurrent_kernel, ops.greedy_kernel) == (False, False)
    assert ops.inplace_recurrent and ops.fused_conv_gates and ops.fused_conv_projection
    assert "greedy token by torch ops" in note and "fla's AR recurrence" in note
    broken["fused_conv_gates"] = "swiglu"      # no switch clears it
    with pytest.raises(RuntimeError, match="swiglu"):
        graph_ops._checked_ops("fused", PUBLIC_1P3B, "cpu", torch.bfloat16)
