"""The measured tree preset's choice (`specla.train.tree_preset`): ranks recorded from steps,
the two ways of choosing a tree from them, and the tau a preset gets on recorded steps."""
from __future__ import annotations

import random

from specla.train.tree_preset import (best_preset, empirical_preset, expected_tau, measured_tau, rank_acceptance,
                                      true_ranks)


def is_tree(paths: list[list[int]]) -> bool:
    """Every path's parent is listed before it."""
    seen: set[tuple[int, ...]] = {()}
    for path in paths:
        if tuple(path[:-1]) not in seen:
            return False
        seen.add(tuple(path))
    return True


def test_true_ranks_stop_at_the_first_slot_without_its_token():
    candidates = [[5, 6, 7], [8, 9, 1], [2, 3, 4], [1, 1, 1]]
    assert true_ranks(candidates, [6, 1, 0, 1]) == [1, 2, -1]
    assert true_ranks(candidates, [5, 8]) == [0, 0]        # the future ends first


def test_empirical_preset_keeps_what_the_rank_table_loses():
    """Slot 1's rank depends on slot 0's: after a rank-1 slot 0, slot 1's answer is its rank 1
    (the drafter put the right token one place off), after rank 0 its rank 0. The table
    averages that away and spends a node on a path no step takes; the most frequent paths do not."""
    steps = [[0, 0]] * 40 + [[1, 1]] * 35 + [[2, -1]] * 25
    by_table, empirical = best_preset(rank_acceptance(steps, 2, 3), 5), empirical_preset(steps, 5)
    assert is_tree(by_table) and is_tree(empirical) and len(by_table) == len(empirical) == 5
    assert empirical == [[0], [1], [2], [0, 0], [1, 1]]
    assert [0, 1] in by_table and [1, 1] not in by_table
    assert measured_tau(steps, empirical) == 1 + (40 + 35 + 25 + 40 + 35) / 100
    assert measured_tau(steps, by_table) == 1 + (40 + 35 + 25 + 40) / 100


def test_both_choices_agree_when_the_slots_are_independent():
    """With ranks drawn independently per slot, the table is the steps' law: both choices reach
    the same measured tau (up to sampling), and the table's expected tau predicts it."""
    rng = random.Random(0)
    law = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    steps = []
    for _ in range(20000):
        ranks = []
        for row in law:
            u, r = rng.random(), -1
            for i, p in enumerate(row):
                if u < p:
                    r = i
                    break
                u -= p
            ranks.append(r)
            if r < 0:
                break
        steps.append(ranks)
    by_table, empirical = best_preset(rank_acceptance(steps, 3, 3), 7), empirical_preset(steps, 7)
    assert is_tree(by_table) and is_tree(empirical)
    assert abs(measured_tau(steps, empirical) - measured_tau(steps, by_table)) < 0.02
    assert abs(expected_tau(law, by_table) - measured_tau(steps, by_table)) < 0.03
