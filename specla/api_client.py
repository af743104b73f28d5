"""Driving the app's HTTP API from Python with gradio_client (the app itself never imports this).

    from gradio_client import Client
    job = Client("http://127.0.0.1:7860/").submit(prompt="def f(x):\n", api_name="/run")
    for update in arrivals(job):        # each streamed update, as it arrives
        print(update[0])                # the status line
"""
from __future__ import annotations

import time
from typing import Any, Iterator


def arrivals(job: Any, poll_s: float = 0.002) -> Iterator[Any]:
    """A gradio_client Job's outputs as they arrive, the last one included.

    gradio_client's own iterator (`for update in job`) sleeps while it holds the lock that the
    job's reader thread needs to append each output, so that thread can wait for seconds and
    the updates reach the caller late, all at once. This polls with the lock free.
    """
    seen = 0
    while True:
        done = job.done()                 # read first: the outputs read next are then complete
        outputs = job.outputs()
        while seen < len(outputs):
            yield outputs[seen]
            seen += 1
        if done:
            return
        time.sleep(poll_s)
