"""Take the README's screenshots: the app at 1280x720 after running the first example.

    python docs/screenshot.py --view text    # docs/screenshot.png: prompt, examples, output, summary
    python docs/screenshot.py --view step    # docs/screenshot-step.png: scrubber, step in words, tree

Starts the app in this process on a free port (the embedded model, CPU), drives Debian's
chromium with Playwright, runs the first example with the LiLiCorr drafter, scrolls to
the prompt or to the step scrubber, and saves that screen.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for key, value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default: docs/screenshot[-step].png")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--drafter", default="lilicorr")
    ap.add_argument("--view", choices=("step", "text"), default="text",
                    help="step: the scrubber, the step in words and the tree; text: prompt, output and summary")
    args = ap.parse_args(argv)
    args.out = args.out or ROOT / "docs" / ("screenshot-step.png" if args.view == "step" else "screenshot.png")

    import torch
    from playwright.sync_api import expect, sync_playwright

    from specla import explorer, runner

    torch.set_num_threads(1)
    runtime = runner.load_runtime(device="cpu")
    demo = explorer.build_demo(runtime)
    demo.queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, url, _ = demo.launch(prevent_thread_lock=True, ssr_mode=False, server_port=port, quiet=True,
                            **explorer.LAUNCH_KWARGS)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(url)
            page.locator("#examples button").first.click()
            page.locator("#drafter input").click()
            page.get_by_role("option", name=args.drafter).click()
            page.locator("#run").click()
            expect(page.locator("#status")).to_contain_text("Done", timeout=120_000)
            anchor = "#scrubber" if args.view == "step" else "#prompt"
            page.locator(anchor).evaluate("el => el.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(500)
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        demo.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
