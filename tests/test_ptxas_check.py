"""benchmarks/ptxas_check.py: the sm_90 register and spill check of the Triton kernels,
compiled on the CPU (no GPU: Triton compiles to PTX and ptxas reports the resources)."""
import os

import pytest

from tests.test_kernels import HEAD_SHAPES

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the check compiles; the interpreter does not")


def test_ptxas_check_reports_the_head_launches():
    """The sm_90 register / spill check compiles both launches of a small head on the CPU."""
    pytest.importorskip("triton")
    from benchmarks import ptxas_check
    fields, S, k, vocab = HEAD_SHAPES["odd"]
    reports = [ptxas_check.launch_report(launch)
               for launch in ptxas_check.head_launches(fields, k, slots=S, vocab=vocab)]
    assert [r["launch"] for r in reports] == ["_head_prologue_kernel", "_lilicorr_head_kernel"]
    for r in reports:
        assert r["instructions"] > 100 and 0 < r["registers"] <= 255 and r["spill_stores"] >= 0


def test_ptxas_check_compiles_the_state_kernels_without_spills():
    """The verification's parallel form at the GDN-1.3B head shape fits sm_90's registers; the
    persistent verify step is recorded (not compiled here: its compile is the slow one)."""
    pytest.importorskip("triton")
    from benchmarks import ptxas_check
    launches = ptxas_check.verify_launches()
    assert sum(launch[0].__name__ == "_chain_verify_kernel" for _, launch in launches) == 1
    big = [launch for case, launch in launches if case.startswith("K=256")]
    assert big, [case for case, _ in launches]
    for launch in big:
        r = ptxas_check.launch_report(launch)
        assert r["instructions"] > 100 and r["registers"] <= 255 and r["spill_stores"] == 0, r


def test_ptxas_check_records_the_persistent_kernels():
    """The embedded pair's three persistent kernels (the draft also growing a best-first tree)
    are recorded with their launch options, and the AR step (the quickest to compile)
    reports its shared memory and warps."""
    pytest.importorskip("triton")
    from benchmarks import ptxas_check
    launches = ptxas_check.persistent_launches()
    names = [launch[0].__name__ for _, launch in launches]
    assert names == ["_decode_step_kernel", "_chain_verify_kernel", "_block_draft_kernel", "_block_draft_kernel"]
    assert launches[2][1][2]["num_warps"] == 8
    assert launches[3][1][2]["TREE"] and launches[3][1][2]["TREE_NODES"] == 16
    r = ptxas_check.launch_report(launches[0][1])
    assert r["shared_bytes"] > 0 and r["warps"] == 4 and 0 < r["registers"] <= 255, r
