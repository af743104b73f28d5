"""The model-free n-gram drafter: its tensor core against plain Python, and the engine with it."""
from __future__ import annotations

import math
import random

import pytest
import torch

from specla.decode import DecodeSettings, ar_generate, speculative_steps
from specla.drafters.base import Accepted, DraftContext, DraftSettings
from specla.drafters.ngram import NgramDrafter, append, continuations, trie
from tests.helpers import random_target


pytestmark = pytest.mark.usefixtures("one_thread")     # tiny models: two threads thrash a small CPU


# ---------------------------------------------------------------- plain-Python references

def reference_continuations(h: list[int], *, max_ngram, min_ngram, width, depth, pool, order):
    """Rows (tokens, score) best first, written the obvious way."""
    last = len(h) - 1
    found = []
    for p in range(last):
        m = 0
        while m < max_ngram and p - m >= 0 and h[p - m] == h[last - m]:
            m += 1
        if m >= min_ngram:
            found.append((m, p))
    found = sorted(found, reverse=True)[:pool]
    follow = {c: h[c[1] + 1:c[1] + 1 + depth] for c in found}

    def covers(a, b):       # b has a's tokens wherever a has one
        return follow[b][:len(follow[a])] == follow[a]

    count = {a: sum(covers(a, b) or covers(b, a) for b in found) for a in found}
    rank = {a: (a[0], count[a], a[1]) if order == "frequency" else a for a in found}
    ranked = sorted(found, key=rank.get, reverse=True)
    kept = [a for i, a in enumerate(ranked) if not any(covers(a, b) for b in ranked[:i])]
    rows = []
    for m, p in kept[:width]:
        score = m + (math.log(count[(m, p)]) if order == "frequency" else 0.0)
        rows.append((follow[(m, p)], score))
    return rows


def reference_trie(rows: list[list[int]], depth: int, width: int):
    tokens, parents = [-1] + [-1] * (width * depth), [-1] + [0] * (width * depth)
    node_of: dict[tuple, int] = {(): 0}
    for w, row in enumerate(rows):
        for d in range(len(row)):
            prefix = tuple(row[:d + 1])
            if prefix not in node_of:
                node_of[prefix] = 1 + w * depth + d
                tokens[node_of[prefix]] = row[d]
                parents[node_of[prefix]] = node_of[prefix[:-1]]
    real = [False] * len(tokens)
    for index in node_of.values():
        real[index] = True
    return tokens, parents, real


def buffer(h: list[int], capacity: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The history in a fixed buffer, the unused tail filled with junk that must not matter."""
    rng = random.Random(seed)
    junk = [rng.randrange(4) for _ in range(capacity - len(h))]
    return torch.tensor(h + junk), torch.tensor([len(h)])


def check_against_reference(h: list[int], capacity: int = 48, **kw) -> None:
    history, length = buffer(h, capacity)
    tokens, valid, score = continuations(history, length, **kw)
    want = reference_continuations(h, **kw)
    got = [([t for t, ok in zip(row, oks) if ok], s)
           for row, oks, s in zip(tokens.tolist(), valid.tolist(), score.tolist()) if oks[0]]
    assert [r for r, _ in got] == [r for r, _ in want], h
    assert [s for _, s in got] == pytest.approx([s for _, s in want])
    assert all(s == -math.inf for s in score.tolist()[len(want):])
    assert tokens[~valid].eq(-1).all()
    node_tokens, parents, is_real = trie(tokens, valid)
    want_tokens, want_parents, want_real = reference_trie([r for r, _ in want], kw["depth"], kw["width"])
    assert node_tokens.tolist() == want_tokens
    assert parents.tolist() == want_parents
    assert is_real.tolist() == want_real


# ---------------------------------------------------------------- the tensor core

SETTINGS = [dict(max_ngram=4, min_ngram=1, width=4, depth=5, pool=16, order="recency"),
            dict(max_ngram=3, min_ngram=2, width=3, depth=4, pool=8, order="frequency"),
            dict(max_ngram=2, min_ngram=1, width=1, depth=6, pool=4, order="recency"),
            dict(max_ngram=5, min_ngram=1, width=6, depth=3, pool=32, order="frequency")]


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: "max{max_ngram}-min{min_ngram}-W{width}-D{depth}-{order}".format(**kw))
def test_continuations_and_trie_equal_the_reference_on_random_histories(kw):
    rng = random.Random(kw["width"] * 100 + kw["depth"])
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 9])
        h = [rng.randrange(vocab) for _ in range(rng.randint(0, 48))]
        check_against_reference(h, **kw)


@pytest.mark.parametrize("h", [
    [],                                   # nothing at all
    [7],                                  # only the root
    [1, 2, 3, 4, 5],                      # no earlier occurrence of the root
    [1, 2, 3, 1, 2, 3],                   # one match, its continuation runs into the suffix
    [5, 5, 5, 5, 5, 5],                   # a run: every position matches, continuations are cut
    [1, 2, 9, 8, 1, 2, 7, 1, 2],          # two continuations after "1 2": 7 (recent) and 9 8
    [3, 1, 2, 4, 1, 2, 4, 0, 1, 2],       # "4" follows twice: frequency beats recency
    [1, 2, 3, 4, 0, 4, 9, 9, 1, 2, 3, 4],  # the longest match wins over the most recent
], ids=["empty", "root-only", "no-match", "match-at-the-end", "run", "two-ways", "frequent", "longest"])
@pytest.mark.parametrize("order", ["recency", "frequency"])
def test_hand_made_histories(h, order):
    check_against_reference(h, max_ngram=4, min_ngram=1, width=3, depth=4, pool=8, order=order)


def test_hand_worked_example():
    """After "1 2" came "9 8 1" once and "4 1 2" twice: by frequency, "4 1 2" first."""
    history, length = buffer([1, 2, 9, 8, 1, 2, 4, 1, 2, 4, 1, 2], 16)
    tokens, valid, score = continuations(history, length, max_ngram=2, min_ngram=1, width=2, depth=3,
                                         pool=8, order="frequency")
    assert tokens.tolist() == [[4, 1, 2], [9, 8, 1]]
    assert score.tolist() == pytest.approx([2 + math.log(2), 2.0])
    node_tokens, parents, is_real = trie(tokens, valid, root=torch.tensor([2]))
    assert node_tokens.tolist() == [2, 4, 1, 2, 9, 8, 1]
    assert parents.tolist() == [-1, 0, 1, 2, 0, 4, 5]
    assert is_real.all()


def test_shared_prefixes_become_dummies_hanging_off_the_root():
    tokens = torch.tensor([[4, 1, 2], [4, 1, 7], [4, 6, -1]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False]])
    node_tokens, parents, is_real = trie(tokens, valid)
    assert node_tokens.tolist() == [-1, 4, 1, 2, -1, -1, 7, -1, 6, -1]
    assert parents.tolist() == [-1, 0, 1, 2, 0, 0, 2, 0, 1, 0]
    assert is_real.tolist() == [True, True, True, True, False, False, True, False, True, False]


def test_shapes_are_static():
    """Any history, any length: the same output shapes and dtypes."""
    kw = dict(max_ngram=3, min_ngram=1, width=4, depth=5, pool=8)
    shapes = set()
    for h in ([], [3], [1, 2, 1, 2, 1, 2], list(range(30)), [0] * 40):
        out = continuations(*buffer(h, 40), **kw)
        out = out + trie(out[0], out[1])
        shapes.add(tuple((tuple(t.shape), t.dtype) for t in out))
    assert shapes == {(((4, 5), torch.long), ((4, 5), torch.bool), ((4,), torch.float32),
                       ((21,), torch.long), ((21,), torch.long), ((21,), torch.bool))}


def test_append_keeps_the_most_recent_tokens():
    rng = random.Random(0)
    capacity = 10
    history, length, plain = torch.full((capacity,), -1), torch.zeros(1, dtype=torch.long), []
    for _ in range(12):
        new = [rng.randrange(50) for _ in range(rng.randint(0, 4))]
        padded = torch.tensor(new + [0] * (4 - len(new)))
        history, length = append(history, length, padded, torch.tensor([len(new)]))
        plain = (plain + new)[-capacity:]
        assert history.shape == (capacity,)
        assert history[:int(length)].tolist() == plain


def test_bad_static_arguments_are_refused():
    history, length = buffer([1, 2, 3], 8)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        continuations(history, length, max_ngram=2, min_ngram=3, width=1, depth=2)
    with pytest.raises(ValueError, match="width <= pool <= history capacity"):
        continuations(history, length, max_ngram=2, min_ngram=1, width=2, depth=2, pool=16)
    with pytest.raises(ValueError, match="order must be one of"):
        continuations(history, length, max_ngram=2, min_ngram=1, width=1, depth=2, pool=4, order="lru")


# ---------------------------------------------------------------- the drafter and the engine

def repeating_prompt(vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    body = [rng.randrange(vocab) for _ in range(12)]
    return body + [rng.randrange(vocab) for _ in range(5)] + body[:6]


# (target, new tokens): "loops" falls into runs of one token after a while, and the drafter
# must then save forwards; "small" does not repeat itself, it checks exactness alone.
TARGETS = {"small": (dict(), 64), "loops": (dict(vocab=16, std=1.0), 80)}


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_speculation_with_the_ngram_drafter_equals_ar(target_name, deferred):
    shape, new_tokens = TARGETS[target_name]
    target = random_target(**shape)
    prompt = repeating_prompt(target.config.vocab_size)
    settings = DecodeSettings(max_new_tokens=new_tokens, deferred=deferred)
    ar = ar_generate(target, prompt, settings)
    for tree, top_k, budget in (("chain", 1, 8), ("beam", 3, 12), ("best-first", 4, 16)):
        drafter = NgramDrafter(target.config.vocab_size, max_ngram=3, capacity=256)
        records = list(speculative_steps(target, drafter, prompt, settings,
                                         DraftSettings(tree=tree, top_k=top_k, budget=budget, depth=6)))
        assert [t for r in records for t in r.new_tokens] == ar.tokens, tree
        assert all(len(r.tree) - 1 <= budget and r.tree.depth <= 6 for r in records)
        if target_name == "loops":
            assert len(records) < 0.8 * len(ar.tokens), tree


def test_sampling_with_the_ngram_drafter_runs_and_stays_in_budget():
    target = random_target()
    prompt = repeating_prompt(target.config.vocab_size, seed=1)
    settings = DecodeSettings(max_new_tokens=24, temperature=0.8, seed=3)
    records = list(speculative_steps(target, NgramDrafter(target.config.vocab_size), prompt, settings,
                                     DraftSettings(tree="best-first", top_k=3, budget=10)))
    assert sum(len(r.new_tokens) for r in records) == 24


def test_the_history_holds_the_prompt_the_accepted_tokens_and_the_bonus():
    drafter = NgramDrafter(100, capacity=64)
    drafter.reset([5, 6, 7, 5, 6], None, torch.zeros(0, 1))
    draft = drafter.propose(DraftContext(6, DraftSettings(tree="chain", depth=4, budget=4)))
    assert draft.tree.tokens == [6, 7, 5, 6]     # what followed "5 6" before, cut at the end
    assert draft.tree.logprobs == [0.0] * 4
    drafter.observe(Accepted(tokens=[6, 7], features=None, last_hidden=torch.zeros(2, 1), bonus_token=9))
    state = drafter.context_state()
    assert state["history"][:int(state["length"])].tolist() == [5, 6, 7, 5, 6, 7, 9]
    with pytest.raises(RuntimeError, match="root is 6"):
        drafter.propose(DraftContext(6, DraftSettings()))


def test_tree_log_probs_are_row_weights():
    """Two rows after "1 2" (recency: 7 first, then 9 8): equal match lengths, equal weights."""
    drafter = NgramDrafter(100, max_ngram=2, capacity=32)
    drafter.reset([1, 2, 9, 8, 1, 2, 7, 1, 2], None, torch.zeros(0, 1))
    draft = drafter.propose(DraftContext(2, DraftSettings(tree="best-first", top_k=2, budget=6, depth=2)))
    tree = draft.tree
    assert sorted(tree.tokens[1:]) == [1, 7, 8, 9]
    first = {tree.tokens[i]: math.exp(tree.logprobs[i]) for i in tree.children[0]}
    assert first == pytest.approx({7: 0.5, 9: 0.5})
