"""The benchmark report is internally consistent.

Runs `python -m specla bench --device cpu --suite e2e --quick` through `specla.bench.main`
on a tiny random target with the oracle drafter (the hidden `--tiny` flag): the rows are
measured through the app's own service layer (`specla.runner.run`). Then checks that every
derived number in e2e.json is what the numbers it comes from say: a speedup is the ratio of
the two medians, tau is tokens over target forwards, tokens/s mirror ms/token, and the stats
agree with their values.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from specla import bench
from specla.bench import common, head, report
from specla.engine import Engine

TOKENS, PROMPTS = 24, 2


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    argv = ["--device", "cpu", "--suite", "e2e", "--quick", "--tiny", "--out", str(folder),
            "--tokens", str(TOKENS), "--prompts", str(PROMPTS)]
    assert bench.main(argv) == 0
    return folder


@pytest.fixture(scope="module")
def rows(out):
    data = json.loads((out / "e2e.json").read_text())
    rows = [r for r in data["pair"]["rows"] if "tau" in r]
    assert rows, f"no measured rows in e2e.json: {data['pair']}"
    return rows


def test_files_and_environment(out):
    for name in ("e2e.json", "report.md", "summary.json"):
        assert (out / name).exists(), name
    env = json.loads((out / "e2e.json").read_text())["environment"]
    assert env["device"] == "cpu" and env["torch"]
    assert "commit" in env["git"] and "--suite e2e" in env["command"]
    report = (out / "report.md").read_text()
    assert "End to end" in report and "oracle/chain-4" in report


def test_speedup_is_the_ratio_of_the_medians(rows):
    for r in rows:
        expected = r["ar_ms_per_token"]["median"] / r["ms_per_token"]["median"]
        assert math.isclose(r["speedup"], expected, rel_tol=1e-9), r["name"]


def test_tau_is_tokens_over_target_forwards(rows):
    for r in rows:
        assert r["tokens"] == TOKENS * PROMPTS, r["name"]           # cut at max_new_tokens
        assert math.isclose(r["tau"], r["tokens"] / r["target_forwards"], rel_tol=1e-12)
        assert 1.0 <= r["tau"] <= 1 + 8                                # bonus + at most 8 drafts


def test_bound_uses_the_verify_time_per_step(rows):
    for r in rows:
        verify = r["time_split_ms_per_step"]["verify"]
        expected = r["tau"] * r["ar_ms_per_token"]["median"] / verify
        assert math.isclose(r["bound"], expected, rel_tol=1e-9), r["name"]


def test_stats_agree_with_their_values(rows):
    for r in rows:
        for key in ("ms_per_token", "tokens_per_s", "ar_ms_per_token"):
            s = r[key]
            assert s["runs"] == len(s["values"]) == PROMPTS, (r["name"], key)
            assert s["min"] <= s["median"] <= s["max"]
            assert math.isclose(s["min"], min(s["values"]), rel_tol=1e-5)
            assert math.isclose(s["max"], max(s["values"]), rel_tol=1e-5)
        for ms, tps in zip(r["ms_per_token"]["values"], r["tokens_per_s"]["values"]):
            assert math.isclose(tps, 1e3 / ms, rel_tol=1e-4)


def test_time_split_is_per_step_and_bounded(rows):
    for r in rows:
        split = r["time_split_ms_per_step"]
        spec_ms_per_step = r["ms_per_token"]["median"] * r["tau"]
        assert all(v >= 0 for k, v in split.items() if k != "host_other"), split
        # the phases of a step cannot add up to much more than the step (medians vs means)
        assert sum(split.values()) < 5 * spec_ms_per_step + 1.0


def test_rows_are_what_the_app_measures(rows):
    """Each row comes from runner.run's traces: the engine that ran it, a speedup per prompt
    whose pooled value the row's speedup summarises."""
    for r in rows:
        assert r["engine"]["backend"] == "eager" and r["app_settings"]["drafter"] == "oracle"
        assert len(r["speedup_per_prompt"]) == PROMPTS
        assert min(r["speedup_per_prompt"]) * 0.5 <= r["speedup"] <= max(r["speedup_per_prompt"]) * 2


def test_speculation_is_exact_in_fp32(rows):
    for r in rows:
        assert r["exact"]["diverging_prompts"] == 0 and r["exact"]["unexcused"] == 0, r["exact"]


def test_render_rewrites_the_report(out):
    (out / "report.md").unlink()
    assert bench.main(["--render", "--out", str(out)]) == 0
    assert "End to end" in (out / "report.md").read_text()


def test_stat_and_timing_helpers():
    s = common.stat([3.0, 1.0, 2.0])
    assert (s["runs"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)
    t = common.timing([10.0, 20.0], tokens=10, bytes_per_step=2_000_000, floor_ms=0.5)
    assert t["ms_per_token"]["median"] == 1.5
    assert math.isclose(t["achieved_GBps"], 2_000_000 / (1.5 * 1e6))
    assert math.isclose(t["fraction_of_floor"], 0.5 / 1.5)
    assert common.ratio(None, 1.0) is None and common.ratio(3.0, 1.5) == 2.0


def test_engine_chain_rows_and_head_share():
    """The head suite's rows, run through the engine on a tiny random pair (graphed bodies run
    eagerly on the CPU): the derived numbers follow from the measured ones, the output is
    exact, and the head share is the step difference over the LiLiCorr step."""
    import torch

    from specla.drafters import new_drafter
    from tests.helpers import random_target

    target = random_target()
    engine = Engine(target, "graphed")
    n, prompts = 16, [common.random_prompt(128, 10, s) for s in range(2)]
    rows = []
    for kind in ("lilicorr", "block"):
        torch.manual_seed(1)
        kw = {"head": {"width": 32, "heads": 2, "layers": 1, "mlp_hidden": 64}} if kind == "lilicorr" else {}
        drafter = new_drafter(kind, target, feature_layers=(0, 1), block_size=4, top_k=4, width=32,
                              heads=2, layers=1, mlp_hidden=64, window=8, **kw)
        settings = dict(common.drafter_settings(kind, drafter))["chain"]
        row = {"name": f"{kind}/{head.DEVICE_LABEL}", "kind": "drafter", "drafter": kind,
               "settings": head.DEVICE_LABEL, **head.engine_chain_row(engine, drafter, settings, prompts, n)}
        assert row["exact"]["diverging_prompts"] == 0, row["exact"]
        assert row["tokens"] == n * len(prompts)
        assert math.isclose(row["tau"], row["tokens"] / row["target_forwards"])
        assert math.isclose(row["speedup"], row["ar_ms_per_token"]["median"] / row["ms_per_token"]["median"])
        split = row["time_split_ms_per_step"]
        assert {"verify", "accept", "draft"} <= set(split) <= {"verify", "accept", "draft", "idle"}
        assert math.isclose(row["gpu_step_ms"], sum(split.values()))
        rows.append(row)
    share = head.head_share(rows)
    l_ms, b_ms = share["lilicorr_step_ms"], share["block_step_ms"]
    assert l_ms == rows[0]["step_ms"]["median"] and b_ms == rows[1]["step_ms"]["median"]
    assert math.isclose(share["head_share_of_graphed_step"], (l_ms - b_ms) / l_ms)
    assert head.head_share(rows[1:])["skipped"]


def test_head_suite_measures_the_share_on_a_tiny_target(tmp_path):
    """`--suite head --tiny` on the CPU: the block and LiLiCorr chains of one drafter decode
    exactly, the share is the step difference over the LiLiCorr step, the report shows it."""
    assert bench.main(["--device", "cpu", "--suite", "head", "--tiny", "--prompt-len", "10",
                       "--tokens", "12", "--out", str(tmp_path)]) == 0
    h = json.loads((tmp_path / "head.json").read_text())
    rows = {r["drafter"]: r for r in h["rows"]}
    assert set(rows) == {"block", "lilicorr"}
    for r in rows.values():
        assert r["exact"]["diverging_prompts"] == 0 and r["tokens"] >= 12 * h["prompts"]
    assert h["head_params"] < h["drafter_params"]
    share = h["share_torch"]
    l_ms, b_ms = rows["lilicorr"]["step_ms"]["median"], rows["block"]["step_ms"]["median"]
    assert math.isclose(share["head_share_of_graphed_step"], (l_ms - b_ms) / l_ms)
    report = (tmp_path / "report.md").read_text()
    assert "LiLiCorr head's share of a decoding step" in report and "Head as torch ops" in report


def test_head_suite_needs_a_gpu_at_full_size(tmp_path):
    assert bench.main(["--device", "cpu", "--suite", "head", "--out", str(tmp_path)]) == 0
    assert "needs a GPU" in json.loads((tmp_path / "head.json").read_text())["skipped"]


def test_targets_say_met_or_by_how_much_missed():
    """The report's verdicts come from the best exact row of each group, the shortfall is the
    target over that speedup, and the free-draft bound drops the draft phase from the step."""
    def row(name, speedup, tau, split, exact=0, alpha=None):
        r = {"name": name, "speedup": speedup, "tau": tau, "ar_ms_per_token": {"median": 0.2},
             "time_split_ms_per_step": split, "exact": {"prompts": 8, "unexcused": exact}}
        return {**r, "alpha": alpha} if alpha is not None else r
    oracle_row = row("chain-8", 3.1, 4.7, {"verify": 1.9, "accept_commit": 0.2, "draft": 0.03}, alpha=0.8)
    oracle_row["ar_ms_per_token"] = 1.44                  # the oracle sweep keeps a single AR figure
    e = {"oracle": {"rows": [oracle_row,
                             row("chain-16", 5.0, 9.0, {"verify": 2.0, "draft": 0.03}, alpha=0.9)]},
         "pair": {"device": "cuda", "rows": [
             row("block", 0.8, 2.4, {"verify": 0.28, "accept_commit": 0.12, "draft": 0.12}),
             row("wrong", 9.0, 5.0, {"verify": 0.1, "draft": 0.1}, exact=2),       # not exact: ignored
             {"name": "cut", "skipped": "deadline"}]}}
    found = {t["target"]: t for t in report.targets(e)}
    assert found["oracle"]["met"] and found["oracle"]["row"] == "chain-8" and found["oracle"]["missed_by"] is None
    assert math.isclose(found["oracle"]["free_draft_bound"], 4.7 * 1.44 / 2.1)
    pair = found["pair_cuda"]
    assert pair["row"] == "block" and not pair["met"]
    assert math.isclose(pair["missed_by"], 2.5 / 0.8)
    assert math.isclose(pair["free_draft_bound"], 2.4 * 0.2 / 0.40)
    text = "\n".join(report._md_targets(e))
    assert "missed by a factor of 3.12" in text and "target 2.5x, best 3.10x (chain-8), met" in text
    e["pair"]["device"] = "cpu"
    assert report.targets(e)[1]["goal"] == 1.5


def _launch_counts_module():
    """benchmarks/launch_counts.py loaded from its file, wherever pytest runs."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "launch_counts.py"
    spec = importlib.util.spec_from_file_location("launch_counts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launch_counts_profiles_every_body_of_a_step(tmp_path, one_thread):
    """benchmarks/launch_counts.py on the CPU: each body of a step is profiled (there its aten
    ops are counted), and a verify of 8 nodes does more work than one AR step."""
    module = _launch_counts_module()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    assert module.main(["--out", str(tmp_path), "--device", "cpu", "--ops", "torch,auto",
                        "--speed-prompts", str(prompts), "--speed-limit", "1", "--tokens", "8"]) == 0
    result = json.loads((tmp_path / "launch_counts.json").read_text())
    assert set(result["variants"]) == {"torch", "auto"} and result["speed"]["prompts"] == 1
    speed = result["variants"]["auto"]["speed"]
    assert speed["ar_ms_per_token"]["median"] > 0 and speed["tau"] >= 1 and speed["exact"]["prompts"] == 1
    bodies = result["variants"]["torch"]["bodies"]
    assert set(bodies) == {"ar_step", "draft", "verify", "accept"}     # the CPU captures nothing to compile
    assert all(b["launches"] > 0 and b["top"] for b in bodies.values())
    assert bodies["verify"]["kernel_us"] > bodies["ar_step"]["kernel_us"]


def test_launch_counts_profiles_the_oracle_step_of_another_model(tmp_path, one_thread):
    """launch_counts.py on one of the runner's other models with its oracle drafter (on the GPU:
    the GDN-1.3B shape, issue #16's profile): the oracle's device step is counted, and the file
    names the model and the bytes its AR step must move (the bench's decode_bytes)."""
    module = _launch_counts_module()
    assert module.main(["--out", str(tmp_path), "--device", "cpu", "--model", "random-tiny",
                        "--drafter", "oracle", "--budget", "8"]) == 0
    result = json.loads((tmp_path / "launch_counts.json").read_text())
    assert "tiny random" in result["model"] and result["settings"]["drafter"] == "oracle"
    floor = result["floor_bytes_parts"]
    assert result["floor_bytes"] == floor["total"] == floor["weights"] + floor["state_rw"] + floor["conv_rw"] > 0
    assert floor["state_rw"] > 0 and "floor_us" not in result          # no GPU: no bandwidth
    bodies = result["variants"]["auto"]["bodies"]
    assert bodies["draft"]["launches"] > 0 and bodies["verify"]["launches"] > bodies["ar_step"]["launches"]
    ar = result["variants"]["auto"]["ar_ms_per_token"]        # the AR step's wall time, any model
    assert 0 < ar["min"] <= ar["median"] <= ar["max"] and ar["tokens"] == 64

def test_the_projection_sweep_covers_each_fused_projection_of_both_models():
    """bench_kernels.py's projection section (GPU only) on the CPU: the shapes it sweeps are the
    packed layer's, its inputs go through the op sets' own projection calls, and its tilings
    include the kernel's default, the widest K block, whole heads for the gated norm, the GEMV
    form for one row only, split-K for the long-K projections, and stay few enough to time."""
    import torch

    from benchmarks import bench_kernels as bk
    from kernels import reference as ref
    from specla.graphs.ops import TorchOps

    models = bk.projection_models()
    assert "gdn-1.3b" in models
    shapes = bk.projection_shapes(models["gdn-1.3b"])
    assert shapes["in (norm)"] == ("norm", 2048, 8208) and shapes["mlp down (swiglu)"] == ("swiglu", 5632, 2048)
    for config in models.values():
        for prologue, K, N in bk.projection_shapes(config).values():
            i = bk.projection_inputs(prologue, 3, K, N, config, torch.device("cpu"), seed=0)
            got = bk.project(TorchOps(), prologue, i)
            if prologue == "norm":
                want = ref.norm_linear_ref(i["x"], i["norm_w"], 1e-6, i["residual"], i["w"])[0]
            elif prologue == "gated_norm":
                want = ref.gated_norm_linear_ref(i["o"], i["gate"], i["norm_w"], 1e-6, i["activation"], i["w"])
            else:
                want = ref.swiglu_linear_ref(i["gate_up"], i["w"])
            assert got.shape == (3, N) and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            head = config.head_v_dim if prologue == "gated_norm" else 0
            for M in (1, 9):
                tilings = bk.projection_tilings(prologue, K, quick=False, M=M, head=head)
                quick = bk.projection_tilings(prologue, K, quick=True, M=M, head=head)
                assert tilings[0] == {} == quick[0] and len(tilings) <= 60 and len(quick) <= 15
                dots = [t for t in tilings[1:] if not t["gemv"]]
                assert {"block_n": 16, "num_stages": 3} in [{k: t[k] for k in ("block_n", "num_stages")} for t in dots]
                assert max(t["block_k"] for t in dots) == min(256, max(head, 1 << (K - 1).bit_length()))
                assert all(t["block_k"] % max(head, 1) == 0 for t in tilings[1:])
                assert any(t["gemv"] for t in tilings[1:]) == (M == 1)
                if K >= 1024:           # the down projections: few columns, a long K
                    assert any(t["split_k"] > 1 for t in dots) and any(t["split_k"] > 1 for t in quick[1:])


def test_the_benchmarks_import_without_plotly():
    """The GPU machine has no plotly: the engine, the runner and the benchmark scripts load
    without it (only the HTML report and the app's figures need it)."""
    repo = Path(__file__).resolve().parent.parent
    code = ("import builtins\nreal = builtins.__import__\n"
            "def no_plotly(name, *a, **k):\n"
            "    if name.split('.')[0] == 'plotly':\n        raise ImportError('plotly blocked')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = no_plotly\n"
            "import specla.runner, specla.engine, specla.bench, benchmarks.launch_counts\n"
            "try:\n    import specla.figures\nexcept ImportError:\n    print('figures need plotly')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "figures need plotly" in proc.stdout      # the block itself works


def test_pair_rows_pick_and_order_the_named_rows():
    from specla.bench.e2e import chosen_rows

    rows = [(name, {}) for name in ("block/chain", "block/preset-15", "block/best-first-10", "ngram/chain-6")]
    assert chosen_rows(rows, "") == rows
    picked = chosen_rows(rows, "ngram/*, block/preset-*,block/*")
    assert [name for name, _ in picked] == ["ngram/chain-6", "block/preset-15", "block/chain", "block/best-first-10"]
    with pytest.raises(ValueError, match="matches no row; the rows are block/chain"):
        chosen_rows(rows, "eagle/*")


def test_gemv_best_picks_the_fastest_tiling_over_both_few_block_projections():
    """The flag of the tiling fastest over the out and down projections together (one
    projection's winner alone does not count), nothing when the rule's defaults win, and an
    error when a projection was not timed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from gemv_best import best_few_blocks

    def row(proj, us, **tiling):
        return {"name": "gemv", "model": "gdn-1.3b", "projection": proj, "M": 1, "us": {"median": us}, **tiling}
    out, down = "out (gated norm)", "mlp down (swiglu)"
    rows = [row(out, 6.0, default={}), row(down, 12.0, default={}),
            row(out, 4.0, block_n=16, block_k=256, split_k=8), row(down, 11.0, block_n=16, block_k=256, split_k=8),
            row(out, 3.0, block_n=8, block_k=256, split_k=8), row(down, 16.0, block_n=8, block_k=256, split_k=8),
            row(out, 1.0, block_n=16, packed=False)]
    best, totals = best_few_blocks(rows)
    assert best == (16, 256, 8) and totals["default"] == 18.0
    assert best_few_blocks(rows[:2] + rows[4:6])[0] is None
    with pytest.raises(ValueError):
        best_few_blocks(rows[:1])
