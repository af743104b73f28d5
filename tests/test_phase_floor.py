"""benchmarks/phase_floor.cu, the join-cost microbenchmark: it builds for sm_90 where CUDA's
compiler is installed, and refuses bad options before it touches a GPU. Timed on the device
by `benchmarks/h200.sh phase-floor`."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def phase_floor(tmp_path_factory) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    exe = tmp_path_factory.mktemp("phase_floor") / "phase_floor"
    build = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-o", str(exe),
                            str(ROOT / "benchmarks" / "phase_floor.cu")], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


@pytest.mark.parametrize("options", [["--rows", "100"], ["--phases", "0"], ["--pool-mb", "-1"], ["--bogus", "1"]])
def test_phase_floor_refuses_bad_options(phase_floor, options):
    run = subprocess.run([str(phase_floor), *options], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() and run.stdout == ""
