"""SpecLA Explorer: the Gradio app (also the Hugging Face Space entry point).

    python app.py                                  # assets/ model + drafters, 127.0.0.1:7860
    python app.py --model random-tiny --port 7861  # random-weight demo model, oracle drafter
    python app.py --device cuda --queue-limit 2 --host 0.0.0.0

On ZeroGPU Spaces the decode runs inside `spaces.GPU` and returns plain trace dicts; the
figures are built on the CPU side. Elsewhere the decorator is a no-op. The page's Model
selector also offers the GDN-1.3B shape (random weights), built on its first run on a GPU.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

for key, value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(key, value)
os.environ.setdefault("GRADIO_TEMP_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".gradio"))

try:
    import spaces
    gpu = spaces.GPU(duration=120)
except ImportError:   # not on a ZeroGPU Space
    def gpu(fn):
        return fn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: assets/target; "
                   "'random-tiny' for a random-weight demo model; 'gdn-1.3b-random' for the GDN-1.3B shape "
                   "with random weights and the oracle drafter, on a GPU)")
    p.add_argument("--drafters", default=None,
                   help="folder with <kind>/ drafter checkpoints (default: assets/drafters)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="target precision (auto: fp32 on the CPU, bf16 on a GPU)")
    p.add_argument("--backend", choices=("auto", "eager", "graphed"), default="auto",
                   help="decoding backend (auto: CUDA graphs on a GPU, the eager loop on the CPU)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    p.add_argument("--queue-limit", "--share-queue-limit", dest="queue_limit", type=int, default=1,
                   help="model runs at the same time across all users (default 1; more needs reentrant drafters)")
    p.add_argument("--max-queue", type=int, default=32, help="requests allowed to wait in the queue")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is steadier on a busy or small CPU)")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model, then serve the page; a model that cannot load ends with one line and status 2."""
    args = parse_args(argv)
    import torch

    from specla import explorer, runner
    from specla.model_choice import ModelChoices

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("specla").setLevel(logging.INFO)   # warnings, and each run's first-step latency
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda was asked for, but no CUDA GPU is available", file=sys.stderr)
        return 2
    try:
        runtime = runner.load_runtime(args.model, args.drafters, args.device, args.dtype, args.backend)
    except (ValueError, OSError) as err:   # ModelFormatError and DrafterFormatError are ValueErrors
        print("error: cannot load the model: " + " ".join(str(err).split()), file=sys.stderr)
        return 2

    models = ModelChoices(runtime)

    @gpu
    def run_on_device(model: str, prompt: str, settings: dict):
        # the model comes as its key, not its runtime: ZeroGPU pickles the arguments
        yield from runner.run(models.runtime(model), prompt, settings)

    demo = explorer.build_demo(runtime, run_fn=run_on_device, model_limit=max(1, args.queue_limit), models=models)
    demo.queue(default_concurrency_limit=4, max_size=args.max_queue)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, ssr_mode=False,
                **explorer.LAUNCH_KWARGS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
