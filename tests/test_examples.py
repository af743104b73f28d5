"""The shipped examples (examples/prompts.jsonl) do what their labels say on the embedded model.

With the page's default settings at temperature 0, every example makes at least 32 tokens,
and its tau (tokens per target forward) lands on the side its label claims: drafting
"pays", "pays a little" or "does not pay".
"""
import copy
import json
from pathlib import Path

import pytest

from specla import runner
from specla.decode import DecodeSettings, speculative_steps
from specla.drafters.base import DraftSettings
from specla.explorer import EXAMPLES_FILE, load_examples

MIN_TOKENS = 32
TAU_RANGE = {"pays": (2.5, 99.0), "pays a little": (1.8, 2.8), "does not pay": (0.0, 1.8)}
EXAMPLES = [json.loads(line) for line in Path(EXAMPLES_FILE).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def rt(one_thread):
    if not (runner.ASSETS / "target").exists():
        pytest.skip("the embedded model (assets/target) is absent")
    return runner.load_runtime(device="cpu")


def test_the_examples_cover_both_sides_and_load_with_their_labels():
    assert len(EXAMPLES) >= 6
    shows = [e.get("shows") for e in EXAMPLES]
    assert set(shows) <= set(TAU_RANGE) and {"pays", "does not pay"} <= set(shows)
    assert {"pays", "does not pay"} <= set(shows[:6]), "the first page of examples shows both"
    prompts, labels = load_examples()
    assert [p[0] for p in prompts] == [e["prompt"] for e in EXAMPLES]
    assert labels == [e["label"] for e in EXAMPLES]
    for example in EXAMPLES:
        assert example["label"].lower().startswith(example["shows"]), example["label"]


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[e["label"].split(":")[0] + f" #{i}" for i, e in enumerate(EXAMPLES)])
def test_an_example_makes_enough_tokens_and_its_tau_matches_its_label(rt, example):
    s = runner.normalize_settings(rt, {})                     # the page's defaults
    drafter = copy.copy(rt.drafters[s["drafter"]])
    draft = DraftSettings(top_k=s["top_k"], budget=s["budget"], block_size=s["block_size"], depth=s["depth"],
                          tree=s["tree"], prune_tau=s["prune_tau"])
    decode = DecodeSettings(max_new_tokens=s["max_new_tokens"], stop_at_eos=True)
    steps = list(speculative_steps(rt.target, drafter, rt.encode(example["prompt"]), decode, draft, rt.eos_token_id))
    tokens = sum(len(step.new_tokens) for step in steps)
    assert tokens >= MIN_TOKENS, f"{tokens} tokens"
    lo, hi = TAU_RANGE[example["shows"]]
    assert lo <= tokens / len(steps) <= hi, f"tau {tokens / len(steps):.2f}"
