"""The page's Model selector: the model loaded at start, and the GDN-1.3B shape built on demand.

The 1.3B shape has random bf16 weights and only the oracle drafter, right with a chosen
probability α: it shows the engine's speed where a step is bound by memory bandwidth, at a
simulated acceptance rate. It needs a CUDA GPU with about `runner.RANDOM_1P3B_GIB` GiB
free, so it is built on the first run that selects it, once for every session (under a
lock), and dropped again when building it or running it runs out of GPU memory, so that
the loaded model keeps working.

    models = ModelChoices(runtime)
    models.unavailable(runner.RANDOM_1P3B)    # "needs a CUDA GPU" on a CPU machine, else None
    runtime = models.runtime(runner.RANDOM_1P3B)   # built once, then shared
"""
from __future__ import annotations

import dataclasses
import gc
import threading
from typing import Any, Callable

import torch

from specla import runner

LOADED = "loaded"       # the key of the model loaded at start
RANDOM_1P3B_LABEL = "GDN-1.3B shape: random weights, simulated acceptance α (GPU)"


def _sentence(text: str) -> str:
    """`text` as a sentence's start: its first letter capitalised, the rest as written (GDN, GPU)."""
    return text[:1].upper() + text[1:]


class ModelUnavailable(ValueError):
    """A model that cannot run here now: no GPU, too little free memory, out of memory.

    A ValueError, so the page shows the message as it shows bad input, with no traceback.
    """


def is_out_of_memory(err: BaseException) -> bool:
    """A CUDA out-of-memory error (torch.cuda.OutOfMemoryError, or a RuntimeError saying so)."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def release_gpu_memory() -> None:
    """Hand the cached blocks of tensors nothing refers to any more back to the driver."""
    gc.collect()                   # tensors held only by reference cycles of a failed build
    torch.cuda.empty_cache()       # a no-op where CUDA was never initialised


@dataclasses.dataclass
class Choice:
    """One entry of the selector, described well enough for the page before it is built."""
    key: str
    label: str                      # the selector's text
    short: str                      # the model in a sentence: "the GDN-1.3B shape"
    name: str                       # the runtime's model_name, which traces record
    note: str
    drafters: dict[str, str]        # drafter name -> label, in the page's order
    device: str                     # "cpu" or "cuda"
    build: Callable[[], runner.Runtime] | None = None    # None: loaded at start, never dropped
    needs_gib: float = 0.0          # free GPU memory the build needs
    runtime: runner.Runtime | None = None

    def describe(self, runtime: runner.Runtime) -> None:
        """Take the built runtime's own description: the page shows what actually runs."""
        self.runtime, self.name, self.note = runtime, runtime.model_name, runtime.note
        self.drafters = {name: runtime.labels[name] for name in runtime.drafters}
        self.device = runtime.device.type


class ModelChoices:
    """The selector's entries by key, and their runtimes, each built at most once at a time."""

    def __init__(self, loaded: runner.Runtime, offer_1p3b: bool = True):
        self.loaded = loaded
        first = Choice(LOADED, loaded.model_name, "the loaded model", "", "", {}, "cpu")
        first.describe(loaded)
        self.choices = {LOADED: first}
        if offer_1p3b and loaded.model_name != runner.RANDOM_1P3B_NAME:   # not when started as the 1.3B
            self.choices[runner.RANDOM_1P3B] = Choice(
                runner.RANDOM_1P3B, RANDOM_1P3B_LABEL, "the GDN-1.3B shape", runner.RANDOM_1P3B_NAME,
                runner.RANDOM_1P3B_NOTE, dict(runner.RANDOM_1P3B_LABELS), "cuda",
                build=lambda: runner.random_1p3b_runtime(), needs_gib=runner.RANDOM_1P3B_GIB)
        self._lock = threading.Lock()

    def options(self) -> list[tuple[str, str]]:
        """(label, key) pairs for a gr.Dropdown."""
        return [(choice.label, choice.key) for choice in self.choices.values()]

    def get(self, key: Any) -> Choice:
        if not isinstance(key, str) or key not in self.choices:
            raise ValueError(f"unknown model {key!r}; this page has: {', '.join(self.choices)}")
        return self.choices[key]

    def unavailable(self, key: Any) -> str | None:
        """Why `key` cannot run here now ("needs a CUDA GPU", ...); None if it can."""
        choice = self.get(key)
        if choice.runtime is not None or choice.device != "cuda":
            return None
        return runner.gpu_shortfall(choice.needs_gib)

    def hardware(self, key: Any) -> str:
        choice = self.get(key)
        if choice.runtime is not None:
            return runner.hardware_name(choice.runtime.device)
        return runner.hardware_name(torch.device("cuda")) if torch.cuda.is_available() else "a CUDA GPU"

    def limits(self, key: Any, drafter: str) -> dict:
        """Largest block size and top-k of `drafter` on `key` (the defaults until it is built)."""
        runtime = self.get(key).runtime
        return runner.drafter_limits(runtime, drafter) if runtime is not None else dict(runner.DRAFTER_LIMITS)

    def key_for(self, record: Any) -> str | None:
        """The choice a trace's model record names: by fingerprint when built, else by name."""
        if not isinstance(record, dict):
            return None
        fingerprint = record.get("fingerprint")
        for choice in self.choices.values():
            if fingerprint and choice.runtime is not None and fingerprint == choice.runtime.fingerprint:
                return choice.key
        return next((choice.key for choice in self.choices.values() if record.get("name") == choice.name), None)

    def runtime(self, key: Any) -> runner.Runtime:
        """The runtime of `key`, built on first use; sessions asking meanwhile wait for that build."""
        choice = self.get(key)
        if choice.runtime is not None:
            return choice.runtime
        with self._lock:
            if choice.runtime is None:
                choice.describe(self._build(choice))
            return choice.runtime

    def _build(self, choice: Choice) -> runner.Runtime:
        reason = self.unavailable(choice.key)
        if reason:
            raise ModelUnavailable(f"{_sentence(choice.short)} cannot run here: it {reason}; "
                                   f"{self._fallback()}.")
        try:
            return choice.build()
        except ValueError as err:        # the builder's own check, when memory was taken meanwhile
            failure = ModelUnavailable(f"{_sentence(choice.short)} cannot be built here ({err}); "
                                       f"{self._fallback()}.")
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            failure = self._out_of_memory_message(choice, err)
        # here the error and its traceback, which held the half-built model, are gone
        release_gpu_memory()
        raise failure

    def out_of_memory(self, key: Any, err: BaseException) -> ModelUnavailable:
        """After a run on `key` ran out of GPU memory: drop its runtime if it was built on
        demand (the next run builds it again), and return the message for the page. The
        caller frees the memory once it has let go of `err`."""
        choice = self.get(key)
        if choice.build is not None:
            with self._lock:
                choice.runtime = None
        return self._out_of_memory_message(choice, err)

    def _out_of_memory_message(self, choice: Choice, err: BaseException) -> ModelUnavailable:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        if choice.build is None:
            return ModelUnavailable(f"{_sentence(choice.short)} ran out of GPU memory: {detail}. "
                                    "Try fewer new tokens or a smaller tree.")
        return ModelUnavailable(f"{_sentence(choice.short)} ran out of GPU memory: {detail}. Its memory "
                                f"was freed; {self._fallback()}.")

    def _fallback(self) -> str:
        return f"the loaded model ({self.loaded.model_name}) still works: pick it under Model"
