"""Layer 3: a real browser (Debian's chromium driven by Playwright) uses the page.

On a 1280x720 screen (a classroom projector): pick an example, run it, step through it,
check that every view drew data, download the trace, upload it back and see the views,
the prompt and the settings return; stop a long run and check what it kept; check token
text in the SVG and the upload limit. A screenshot is saved (to $SPECLA_SCREENSHOT_DIR when
set, else the test's temp dir). CI installs chromium with apt
(`apt-get install -y chromium chromium-driver`; never `playwright install`).
"""
import os
from pathlib import Path

for _key, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_key, _value)
os.environ.setdefault("GRADIO_TEMP_DIR", str(Path(__file__).resolve().parent.parent / ".gradio"))

import json  # noqa: E402
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
from specla.trace import MAX_TRACE_BYTES, load_trace  # noqa: E402
from tests.helpers import default_runtime, served  # noqa: E402

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
PLOTS = ("tree-plot", "lattice-plot", "commit-plot", "speedup-plot")
PROJECTOR = {"width": 1280, "height": 720}
TIMEOUT = 90_000
STOP_CLICK_MS = 30_000   # a click mid-run lands in under a second unless the page draws behind the stream
STEP_PAUSE_S = 0.01   # per decoded step
LONG_RUN_PAUSE_S = 0.05   # per step of a run of 256+ tokens: it lasts 10 s or more, so Stop lands mid-run
                          # even when a busy 2-CPU machine shows the first step seconds late


class Engine:
    """runner.run as the page calls it, recording what the decoder produced and when it was closed."""

    def __init__(self, runtime):
        self.runtime, self.pulled, self.closed = runtime, 0, False

    def __call__(self, model, prompt, settings):
        self.pulled, self.closed = 0, False
        pause = LONG_RUN_PAUSE_S if settings.get("max_new_tokens", 0) >= 256 else STEP_PAUSE_S
        try:
            for update in runner.run(self.runtime, prompt, settings):
                self.pulled += 1
                if update is None:
                    time.sleep(pause)
                yield update
        finally:
            self.closed = True


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def app():
    rt = default_runtime()
    engine = Engine(rt)
    with served(explorer.build_demo(rt, run_fn=engine)) as address:
        yield address, engine, rt


@pytest.fixture(scope="module")
def page(app):
    with sync_api.sync_playwright() as p:
        profile = tempfile.mkdtemp(prefix="specla-chromium-")
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS, accept_downloads=True,
            viewport=PROJECTOR)
        pg = context.new_page()
        pg.set_default_timeout(TIMEOUT)
        pg.goto(app[0])
        pg.locator("#run").wait_for()
        yield pg
        context.close()
        shutil.rmtree(profile, ignore_errors=True)


def plot_traces(page) -> dict[str, int]:
    """Number of plotly traces drawn in each view."""
    return {pid: page.locator(f"#{pid} .js-plotly-plot").evaluate("el => (el.data || []).length")
            for pid in PLOTS}


def expect_status(page, text) -> None:
    sync_api.expect(page.locator("#status")).to_contain_text(text, timeout=TIMEOUT)


def set_max_new(page, n: int) -> None:
    box = page.locator("#max-new input[type=number]")
    box.fill(str(n))
    box.press("Enter")


def upload(page, path) -> None:
    with page.expect_file_chooser() as chooser:
        page.locator("#upload").click()
    chooser.value.set_files(str(path))


def download_trace(page, tmp_path, name: str) -> dict:
    page.locator("#export").click()
    sync_api.expect(page.locator("#download")).to_be_visible()
    with page.expect_download() as info:
        page.locator("#download").click()
    saved = tmp_path / name
    info.value.save_as(saved)
    return load_trace(saved)          # checks the trace invariant too


def test_run_step_download_upload(page, tmp_path):
    expect = sync_api.expect
    page.locator("#examples button").first.click()
    prompt = page.locator("#prompt textarea").input_value()
    assert prompt.strip()
    set_max_new(page, 24)
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

    trace = download_trace(page, tmp_path, "downloaded.json")
    assert trace["prompt"] == prompt and len(trace["output"]["tokens"]) == tokens

    # reset and change the prompt and a setting; the replay brings back the views, the prompt and the settings
    page.locator("#reset").click()
    expect_status(page, "Ready.")
    expect(page.locator("#text .tok")).to_have_count(0)
    page.locator("#prompt textarea").fill("something else")
    set_max_new(page, 99)
    upload(page, tmp_path / "downloaded.json")
    expect_status(page, "Replaying")
    expect_status(page, "every setting are restored")
    expect(page.locator("#text .tok")).to_have_count(tokens)
    expect(page.locator("#prompt textarea")).to_have_value(prompt)
    expect(page.locator("#max-new input[type=number]")).to_have_value("24")
    replayed = plot_traces(page)
    assert replayed["tree-plot"] >= 3 and replayed["speedup-plot"] == drawn["speedup-plot"], replayed

    # a foreign file is refused with a message; the page keeps working
    bad = tmp_path / "foreign.json"
    bad.write_text('{"hello": "world"}')
    upload(page, bad)
    expect_status(page, "not a SpecLA trace")
    expect(page.locator("#text .tok")).to_have_count(tokens)

    shots = Path(os.environ.get("SPECLA_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "explorer.png"), full_page=True)
    assert (shots / "explorer.png").stat().st_size > 10_000


def test_stop_halts_a_long_run_and_keeps_a_consistent_trace(page, app, tmp_path):
    _, engine, _ = app
    page.locator("#prompt textarea").fill("import os\n\n\ndef main():\n")
    set_max_new(page, 512)
    page.locator("#run").click()
    sync_api.expect(page.locator("#status")).to_contain_text(re.compile(r"Running: step [1-9]"), timeout=TIMEOUT)
    page.locator("#stop").click(timeout=STOP_CLICK_MS)
    expect_status(page, "Stopped after")
    deadline = time.time() + 10
    while not engine.closed and time.time() < deadline:
        time.sleep(0.05)
    assert engine.closed, "the decoder's generator was closed: decoding stopped"
    pulled = engine.pulled
    time.sleep(1.0)
    assert engine.pulled == pulled, "nothing was decoded after the stop"
    shown = page.locator("#text .tok").count()
    assert 0 < shown < 512
    status = page.locator("#status").inner_text()
    steps, n_tokens = map(int, re.search(r"Stopped after (\d+) steps? \((\d+) tokens?\)", status).groups())
    assert n_tokens == shown
    trace = download_trace(page, tmp_path, "stopped.json")
    assert len(trace["steps"]) == steps == trace["summary"]["target_forwards"]
    assert len(trace["output"]["tokens"]) == trace["summary"]["new_tokens"] == shown < 512
    assert sum(len(s["new_tokens"]) for s in trace["steps"]) == shown


def test_token_text_is_escaped_once_in_the_svg(page, app, tmp_path):
    _, _, rt = app
    drafter = "lilicorr" if "lilicorr" in rt.drafters else runner.ORACLE
    trace = [t for t in runner.run(rt, "def f(x):\n", {"drafter": drafter, "max_new_tokens": 8}) if t][-1]
    step = trace["steps"][0]
    odd = ['"""', "a&b", "<i>x", "it's"]
    targets = step["tree"]["tokens"][1:] + ((step.get("lattice") or {}).get("candidates") or [[]])[0]
    for token, text in zip(targets, odd * 4):
        trace["token_text"][str(token)] = text
    path = tmp_path / "odd-text.json"
    path.write_text(json.dumps(trace))
    upload(page, path)
    expect_status(page, "Replaying")
    sync_api.expect(page.locator("#tree-plot .gtitle")).to_contain_text("step 0")
    texts = page.locator("#tree-plot svg text, #lattice-plot svg text").evaluate_all(
        "els => els.map(e => e.textContent)")
    joined = "\n".join(texts)
    for entity in ("&amp;", "&quot;", "&lt;", "&gt;", "&#"):
        assert entity not in joined, entity
    for text in odd:
        assert text in texts, f"{text!r} is drawn as typed"


def test_the_step_views_fit_a_projector_screen(page):
    set_max_new(page, 24)
    page.locator("#run").click()
    expect_status(page, "Done")
    page.locator("#scrubber").evaluate("el => el.scrollIntoView({block: 'start'})")
    for view in ("#scrubber", "#step-info", "#tree-plot"):
        box = page.locator(view).bounding_box()
        assert box and box["y"] >= 0 and box["y"] + box["height"] <= PROJECTOR["height"], (view, box)


def test_an_oversized_upload_is_refused_in_the_status(page, tmp_path):
    before = page.locator("#text .tok").count()
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1024)          # sparse: nothing written
    upload(page, big)
    expect_status(page, "the limit is 20 MiB. Nothing was uploaded.")
    time.sleep(1.0)
    sync_api.expect(page.locator("#status")).to_contain_text("Nothing was uploaded")
    assert page.locator("#text .tok").count() == before
    temp = Path(os.environ["GRADIO_TEMP_DIR"])
    assert not list(temp.rglob("big.json")), "the file never reached the server"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA says")
def test_the_1p3b_model_says_what_it_needs_and_the_loaded_one_stays(page):
    selector = page.locator("#model input")
    loaded = selector.input_value()
    sync_api.expect(page.locator("#model")).to_contain_text("needs a CUDA GPU here")
    selector.click()
    page.get_by_role("option", name="GDN-1.3B shape: random weights, simulated acceptance α (GPU)").click()
    expect_status(page, "cannot run here: it needs a CUDA GPU. The loaded model stays selected.")
    sync_api.expect(selector).to_have_value(loaded)
    sync_api.expect(page.locator("#model-line")).to_contain_text(loaded)
