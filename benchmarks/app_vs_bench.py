"""The app's numbers against the bench's, in one session on one machine.

    python benchmarks/app_vs_bench.py --out DIR [--prompts FILE] [--limit 8] [--tokens 128]

Starts `python app.py` (the real server, on the GPU when there is one), drives its HTTP API
with gradio_client as a browser session would (Run, then Export the session's trace), for
each case: the block chain, the LiLiCorr chain, LiLiCorr best-first 16 and EAGLE best-first
16, on held-out prompts. Then measures the same cases with `python -m specla bench`'s pair
rows in this process. Writes app_vs_bench.json: per case the app's speedup and AR tokens/s
(medians over the prompts), the bench's, their ratios, and GraphedAR's tokens/s measured
directly; the latency from Run to the first drawn step on a warm app; two concurrent
sessions each getting their own trace.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.perf_counter()
sys.path.insert(0, str(ROOT))

CASES = {  # name: the app's settings (the controls a user sets)
    "block chain": {"drafter": "block", "tree": "chain", "block_size": 8, "top_k": 4, "budget": 7},
    "lilicorr chain": {"drafter": "lilicorr", "tree": "chain", "block_size": 8, "top_k": 4, "budget": 7},
    "lilicorr best-first 16": {"drafter": "lilicorr", "tree": "best-first", "block_size": 8, "top_k": 4,
                               "budget": 16},
    "eagle best-first 16": {"drafter": "eagle", "tree": "best-first", "top_k": 4, "budget": 16, "depth": 6},
}


def case_named(text: str) -> str:
    """A case by its name, spaces and hyphens ignored ("lilicorr_best-first_16" works where a
    shell would split the name)."""
    squash = lambda name: "".join(ch for ch in name.lower() if ch.isalnum())  # noqa: E731
    found = [name for name in CASES if squash(name) == squash(text)]
    if not found:
        raise SystemExit(f"unknown case {text.strip()!r}; the cases are: {', '.join(CASES)}")
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port)] + extra
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def connect(url: str, proc: subprocess.Popen, timeout: float = 240.0):
    from gradio_client import Client

    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with code {proc.returncode}")
        try:
            return Client(url, verbose=False)
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(2)
    raise TimeoutError(f"the app did not answer at {url} within {timeout:.0f} s")


def controls(client, settings: dict) -> dict:
    """The /run endpoint's keyword arguments: every control, from the API's own description."""
    from specla.explorer import CONTROL_DEFAULTS

    values = {**CONTROL_DEFAULTS, **settings}
    names = [p["parameter_name"] for p in client.view_api(print_info=False, return_format="dict")
             ["named_endpoints"]["/run"]["parameters"]]
    return {name: values[name] for name in names if name in values}


def app_run(client, prompt: str, settings: dict) -> tuple[dict, float | None]:
    """Run one prompt through the app's API and export the session's trace. Returns the trace
    and the seconds from submit to the first update that shows a decoded step."""
    from specla.api_client import arrivals

    kwargs = controls(client, settings)
    start = time.perf_counter()
    job = client.submit(prompt=prompt, **kwargs, api_name="/run")
    first_step, timeline = None, []
    for update in arrivals(job):
        status = update[0] if isinstance(update, (list, tuple)) else update
        if isinstance(status, str) and (not timeline or timeline[-1][1] != status[:60]) and len(timeline) < 8:
            timeline.append((round(time.perf_counter() - start, 3), status[:60]))   # when each status arrived
        shown = isinstance(status, str) and (re.search(r"Running\*\*: step [1-9]", status) or "**Done**" in status)
        if first_step is None and shown:
            first_step = time.perf_counter() - start
    job.result()
    exported = client.predict(api_name="/export")
    path = exported[0] if isinstance(exported, (list, tuple)) else exported
    path = path.get("value", path.get("path")) if isinstance(path, dict) else path
    trace = json.loads(Path(path).read_text())
    trace["client_timeline"] = timeline
    return trace, first_step


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=Path, default=ROOT / "data" / "corpus" / "heldout_prompts.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--app-args", default="", help="extra arguments for app.py (e.g. '--device cuda')")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from specla.acceptance import read_prompts

    texts = read_prompts(args.prompts, args.limit)
    cases = [case_named(c) for c in args.cases.split(",") if c.strip()]
    result = {"command": " ".join(["python benchmarks/app_vs_bench.py"] + (argv or sys.argv[1:])),
              "commit": os.environ.get("SPECLA_COMMIT"), "prompt_file": str(args.prompts),
              "prompts": len(texts), "new_tokens": args.tokens, "cases": {}}
    port = free_port()
    proc = start_app(port, args.out / "app_server.log", args.app_args.split())
    try:
        client = connect(f"http://127.0.0.1:{port}/", proc)
        print(f"[app] up at {client.src} [{time.perf_counter() - STARTED:.0f} s]", flush=True)
        for name in cases:
            settings = dict(CASES[name], max_new_tokens=args.tokens)
            app_run(client, texts[0], settings)                      # warm: captures for these settings
            traces, latency = [], []
            for text in texts:
                trace, first = app_run(client, text, settings)
                traces.append(trace)
                latency.append(first)
            result["cases"][name] = {
                "app_speedups": [t["summary"]["speedup"] for t in traces],
                "app_ar_tokens_per_s": [t["baseline"]["tokens_per_s"] for t in traces],
                "app_tokens_per_s": [t["summary"]["tokens_per_s"] for t in traces],
                "app_tau": [t["summary"]["tau"] for t in traces],
                "app_engine": traces[0].get("engine"), "app_exactness": [t.get("exactness") for t in traces],
                "seconds_to_first_step": latency, "stages_ms": [t.get("latency_ms") for t in traces],
                "client_timelines": [t["client_timeline"] for t in traces]}
            print(f"[app] {name}: speedup {median(result['cases'][name]['app_speedups']):.2f}x, first step "
                  f"{median(latency):.2f} s after Run (median) [{time.perf_counter() - STARTED:.0f} s]", flush=True)
            bench_case(result, name, texts, args)
            save(args.out, result)
        result["two_sessions"] = two_sessions(f"http://127.0.0.1:{port}/", read_prompts(args.prompts, 2), args.tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # the server's side of the same latency, every run in order (warm-ups and the two sessions too)
    result["server_first_step_ms"] = [float(ms) for ms in re.findall(
        r"first step drawn (\d+) ms after Run", (args.out / "app_server.log").read_text())]
    save(args.out, result)
    bench_rest(result, texts, args)
    save(args.out, result)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, list)}
                      for k, v in result["cases"].items()}, indent=1))
    return 0


def save(out: Path, result: dict) -> None:
    """Rewritten after every case, so a run cut short keeps what it measured."""
    (out / "app_vs_bench.json").write_text(json.dumps(result, indent=1))


def two_sessions(url: str, texts: list[str], tokens: int) -> dict:
    """Two clients (two browser sessions) run different prompts at once; each exports its own."""
    from gradio_client import Client

    settings = dict(CASES["block chain"], max_new_tokens=tokens)
    got: dict[int, dict] = {}

    def session(i: int) -> None:
        got[i] = app_run(Client(url, verbose=False), texts[i], settings)[0]

    threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"prompts_match": [got[i]["prompt"] == texts[i] for i in range(2)],
            "distinct_outputs": got[0]["output"]["tokens"] != got[1]["output"]["tokens"]}


_BENCH: dict = {}


def bench_runtime():
    """The bench's runtime, loaded once in this process (beside the app's server process)."""
    from specla import runner

    if "runtime" not in _BENCH:
        _BENCH["runtime"] = runner.load_runtime()
    return _BENCH["runtime"]


def bench_case(result: dict, name: str, texts: list[str], args) -> None:
    """The bench's pair row for one case (runner.run in this process), right after the app's."""
    from specla.bench.e2e import pair_row

    row = pair_row(bench_runtime(), texts, dict(CASES[name], max_new_tokens=args.tokens))
    case = result["cases"][name]
    case["bench_speedup"] = row["speedup"]
    case["bench_speedups"] = row["speedup_per_prompt"]
    case["bench_ar_tokens_per_s"] = 1e3 / row["ar_ms_per_token"]["median"]
    case["bench_tau"] = row["tau"]
    case["app_over_bench_speedup"] = median(case["app_speedups"]) / row["speedup"]
    case["app_ar_over_bench_ar"] = median(case["app_ar_tokens_per_s"]) / case["bench_ar_tokens_per_s"]
    case["within_10_percent"] = abs(case["app_over_bench_speedup"] - 1) <= 0.10
    case["bench_split_ms_per_step"] = row["time_split_ms_per_step"]
    case["bench_engine"] = row["engine"]
    case["bench_exact"] = row["exact"]
    print(f"[bench] {name}: speedup {row['speedup']:.2f}x, app / bench {case['app_over_bench_speedup']:.3f} "
          f"[{time.perf_counter() - STARTED:.0f} s]",
          flush=True)


def bench_rest(result: dict, texts: list[str], args) -> None:
    """GraphedAR measured directly, and the block chain with the target in fp32."""
    from specla import runner
    from specla.bench.e2e import pair_row
    from specla.decode import DecodeSettings

    runtime = bench_runtime()
    engine = runtime.engine
    rates = [1e3 / engine.ar(runtime.encode(text), DecodeSettings(max_new_tokens=args.tokens), repeats=3).ms_per_token
             for text in texts]
    result["graphed_ar_tokens_per_s"] = median(rates)
    result["backend"] = engine.backend
    for case in result["cases"].values():
        case["app_ar_over_graphed_ar"] = median(case["app_ar_tokens_per_s"]) / result["graphed_ar_tokens_per_s"]
    fp32 = runner.load_runtime(dtype="fp32")
    result["fp32_block_chain"] = pair_row(fp32, texts, dict(CASES["block chain"], max_new_tokens=args.tokens))


if __name__ == "__main__":
    sys.exit(main())
