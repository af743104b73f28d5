"""Layer 3: a real browser (Debian's chromium driven by Playwright) uses the page.

Pick an example, run it, step through it, check that every view drew data, download the
trace, reset, upload the trace back and see the same views; a screenshot is saved (to
$SPECLA_SCREENSHOT_DIR when set, else the test's temp dir). CI installs chromium with apt
(`apt-get install -y chromium chromium-driver`; never `playwright install`).
"""
import os
from pathlib import Path

for _key, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_key, _value)
os.environ.setdefault("GRADIO_TEMP_DIR", str(Path(__file__).resolve().parent.parent / ".gradio"))

import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

CHROMIUM = os.environ.get("SPECLA_CHROMIUM", "/usr/bin/chromium")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent: apt-get install -y chromium chromium-driver", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the Python package only)")

from specla import explorer, runner  # noqa: E402
from specla.trace import load_trace  # noqa: E402
from tests.helpers import default_runtime, free_port  # noqa: E402

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
PLOTS = ("tree-plot", "lattice-plot", "commit-plot", "speedup-plot")
TIMEOUT = 90_000


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def url():
    rt = default_runtime()

    def run_fn(prompt, settings):
        """runner.run, slowed down for prompts marked '# slow' (so Stop can catch a run)."""
        for trace in runner.run(rt, prompt, settings):
            if prompt.startswith("# slow"):
                time.sleep(0.4)
            yield trace

    demo = explorer.build_demo(rt, run_fn=run_fn)
    demo.queue(default_concurrency_limit=4)
    _, address, _ = demo.launch(prevent_thread_lock=True, ssr_mode=False, server_name="127.0.0.1",
                                server_port=free_port(), quiet=True, **explorer.LAUNCH_KWARGS)
    yield address
    demo.close()


@pytest.fixture(scope="module")
def page(url):
    with sync_api.sync_playwright() as p:
        profile = tempfile.mkdtemp(prefix="specla-chromium-")
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS, accept_downloads=True,
            viewport={"width": 1400, "height": 1800})
        pg = context.new_page()
        pg.set_default_timeout(TIMEOUT)
        pg.goto(url)
        pg.locator("#run").wait_for()
        yield pg
        context.close()
        shutil.rmtree(profile, ignore_errors=True)


def plot_traces(page) -> dict[str, int]:
    """Number of plotly traces drawn in each view."""
    return {pid: page.locator(f"#{pid} .js-plotly-plot").evaluate("el => (el.data || []).length")
            for pid in PLOTS}


def expect_status(page, text: str) -> None:
    sync_api.expect(page.locator("#status")).to_contain_text(text, timeout=TIMEOUT)


def test_run_step_download_upload(page, tmp_path):
    expect = sync_api.expect
    page.locator("#examples button").first.click()
    prompt = page.locator("#prompt textarea").input_value()
    assert prompt.strip()
    max_new = page.locator("#max-new input[type=number]")
    max_new.fill("24")
    max_new.press("Enter")
    page.locator("#run").click()
    expect_status(page, "Done")
    expect(page.get_by_test_id("plotly")).to_have_count(4)
    drawn = plot_traces(page)
    assert drawn["tree-plot"] >= 3 and drawn["commit-plot"] >= 3 and drawn["speedup-plot"] >= 5, drawn
    expect(page.locator("#tree-plot .scatterlayer .trace").first).to_be_attached()
    expect(page.locator("#speedup-plot .barlayer .trace").first).to_be_attached()
    tokens = page.locator("#text .tok").count()
    assert 0 < tokens <= 24
    expect(page.locator("#summary")).to_contain_text("measured in this run")

    # Step: the first click decodes the run in the background and reveals step 0, then one per click
    page.locator("#step").click()
    expect_status(page, "Step 0 revealed")
    page.locator("#step").click()
    expect_status(page, "Step 1 revealed")
    expect(page.locator("#tree-plot .gtitle")).to_contain_text("step 1")

    # download the trace
    page.locator("#export").click()
    expect(page.locator("#download")).to_be_visible()
    with page.expect_download() as info:
        page.locator("#download").click()
    saved = tmp_path / "downloaded.json"
    info.value.save_as(saved)
    trace = load_trace(saved)
    assert trace["prompt"] == prompt and len(trace["output"]["tokens"]) == tokens

    # reset, then replay the file: the same views come back without a model run
    page.locator("#reset").click()
    expect_status(page, "Ready.")
    expect(page.locator("#text .tok")).to_have_count(0)
    with page.expect_file_chooser() as chooser:
        page.locator("#upload").click()
    chooser.value.set_files(str(saved))
    expect_status(page, "Replaying")
    expect(page.locator("#text .tok")).to_have_count(tokens)
    replayed = plot_traces(page)
    assert replayed["tree-plot"] >= 3 and replayed["speedup-plot"] == drawn["speedup-plot"], replayed

    # a foreign file is refused with a message; the page keeps working
    bad = tmp_path / "foreign.json"
    bad.write_text('{"hello": "world"}')
    with page.expect_file_chooser() as chooser:
        page.locator("#upload").click()
    chooser.value.set_files(str(bad))
    expect_status(page, "not a SpecLA trace")
    expect(page.locator("#text .tok")).to_have_count(tokens)

    shots = Path(os.environ.get("SPECLA_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    page.locator("#upload").scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "explorer.png"), full_page=True)
    assert (shots / "explorer.png").stat().st_size > 10_000


def test_stop_cancels_a_run_and_keeps_its_steps(page):
    page.locator("#prompt textarea").fill("# slow\ndef g():\n")
    page.locator("#max-new input[type=number]").fill("200")
    page.locator("#max-new input[type=number]").press("Enter")
    page.locator("#run").click()
    sync_api.expect(page.locator("#status")).to_contain_text(re.compile(r"Running: step [1-9]"), timeout=TIMEOUT)
    page.locator("#stop").click()
    expect_status(page, "Stopped after")
    shown = page.locator("#text .tok").count()
    assert 0 < shown < 200
    time.sleep(1.5)                                   # a cancelled run writes nothing more
    sync_api.expect(page.locator("#status")).to_contain_text("Stopped after")
    assert page.locator("#text .tok").count() == shown
