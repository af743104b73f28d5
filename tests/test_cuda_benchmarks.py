"""The CUDA C++ microbenchmarks in benchmarks/ (phase_floor.cu: what a dependent phase costs by
how it is joined; l2_sides.cu: whether the SM that reads a tile keeps it in L2): each builds
for sm_90 where CUDA's compiler is installed, and refuses bad options before it touches a
GPU. Timed on the device by `benchmarks/h200.sh phase-floor` and `l2-sides`."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BAD_OPTIONS = {
    "phase_floor": [["--rows", "100"], ["--phases", "0"], ["--pool-mb", "-1"], ["--bogus", "1"]],
    "l2_sides": [["--steps", "0"], ["--pools", "8,x"], ["--pools", "5000"], ["--second-mb", "-1"], ["--repeats"],
                 ["--bogus", "1"]],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    out = tmp_path_factory.mktemp("cuda_benchmarks")
    exes = {}
    for name in BAD_OPTIONS:
        exe = out / name
        build = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-o", str(exe),
                                str(ROOT / "benchmarks" / f"{name}.cu")], capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-3000:]
        exes[name] = exe
    return exes


@pytest.mark.parametrize("name, options", [(name, o) for name, opts in BAD_OPTIONS.items() for o in opts])
def test_cuda_benchmark_refuses_bad_options(built, name, options):
    run = subprocess.run([str(built[name]), *options], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() and run.stdout == ""
