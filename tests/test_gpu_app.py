"""The page's Model selector on a real GPU: the GDN-1.3B shape built and decoded for real, and a
real CUDA out-of-memory error while building it (the CPU tests use stand-ins for both)."""
import os
import warnings

for _key, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

from specla import runner  # noqa: E402
from specla.explorer import Explorer, control_values  # noqa: E402

ONE_B, DONE, ERROR = runner.RANDOM_1P3B, "**Done**", "**Error:**"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def rt():
    return runner.load_runtime(device="cuda")


def run(ex: Explorer, model: str, **settings) -> list[tuple]:
    settings.setdefault("drafter", runner.ORACLE)
    values = control_values(ex.runtime, **settings, model=model)     # names every drafter: builds nothing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return list(ex.on_run("def add(a, b):\n    return", *values))


def last_trace(outs: list[tuple]) -> dict:
    return [o[9] for o in outs if isinstance(o[9], dict) and "steps" in o[9]][-1]


def test_a_real_out_of_memory_building_the_1p3b_is_a_message_and_the_loaded_model_still_runs(rt):
    ex = Explorer(rt)
    drafter = next(iter(rt.drafters))
    assert run(ex, "loaded", drafter=drafter, max_new_tokens=32)[-1][0].startswith(DONE)   # its graphs, captured
    total = torch.cuda.get_device_properties(0).total_memory
    # room for the loaded model's runs, not for the 1.3B's 2.9 GB of weights
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + 2**30) / total))
    try:
        status = run(ex, ONE_B, max_new_tokens=16)[-1][0]
        assert status.startswith(ERROR) and "The GDN-1.3B shape ran out of GPU memory" in status, status
        assert "still works" in status and ex.models.get(ONE_B).runtime is None
        loaded = run(ex, "loaded", drafter=drafter, max_new_tokens=32)
        assert loaded[-1][0].startswith(DONE), loaded[-1][0]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_1p3b_choice_builds_and_decodes_on_the_gpu(rt):
    ex = Explorer(rt)
    outs = run(ex, ONE_B, oracle_alpha=0.8, tree="chain", budget=8, max_new_tokens=48)
    assert any(str(o[0]).startswith("Building the GDN-1.3B shape") for o in outs)
    assert outs[-1][0].startswith(DONE), outs[-1][0]
    trace = last_trace(outs)
    assert trace["model"]["name"] == runner.RANDOM_1P3B_NAME and trace["engine"]["backend"] == "graphed"
    assert trace["summary"]["new_tokens"] == 48 and trace["summary"]["tau"] > 2    # α 0.8, chain of 8
    exactness = trace["exactness"]
    assert exactness["equal"] or exactness["first_divergence"]["near_tie"], exactness
    assert run(ex, "loaded", drafter=next(iter(rt.drafters)), max_new_tokens=16)[-1][0].startswith(DONE)
