"""Hybrid drafting's per-round choice by measured goodput (router/hybrid.py), against
simulated clusters whose arms yield known tokens per second."""

from __future__ import annotations

import pytest

from router.hybrid import EXPLORE_EVERY, MIN_SAMPLES, HybridArm, HybridChoice


def run(choice: HybridChoice, matched: int, rates: dict[bool, float], rounds: int) -> list[bool]:
    """`rounds` rounds at one match length where lookup yields rates[True] tokens/s and the
    pool rates[False] (3 tokens a round); what each round drafted by (True: lookup)."""
    chosen = []
    for _ in range(rounds):
        arm = choice.choose(matched)
        choice.observe(arm, 3, 3 / rates[arm.lookup])
        chosen.append(arm.lookup)
    return chosen


def test_without_a_match_the_pool_drafts_and_nothing_is_measured():
    choice = HybridChoice(min_ngram=2)
    assert choice.choose(0) == HybridArm(0, False)
    choice.observe(HybridArm(0, False), 3, 0.01)
    assert all(arm["pool_rounds"] == 0 for arm in choice.describe().values())


@pytest.mark.parametrize("matched, expected", [(1, False), (2, True), (4, True), (9, True)])
def test_before_measuring_the_prior_is_the_match_length_threshold(matched, expected):
    assert HybridChoice(min_ngram=2).choose(matched).lookup is expected


@pytest.mark.parametrize("matched, rates, best", [
    (1, {True: 300.0, False: 150.0}, True),     # the prior says pool at n = 1: measured, lookup wins
    (3, {True: 120.0, False: 200.0}, False),    # the prior says lookup at n = 3: measured, the pool wins
    (2, {True: 250.0, False: 200.0}, True),
])
def test_the_measured_faster_arm_drafts_once_both_are_known(matched, rates, best):
    choice = HybridChoice(min_ngram=2)
    chosen = run(choice, matched, rates, 200)
    settled = chosen[4 * MIN_SAMPLES:]
    assert sum(lookup == best for lookup in settled) >= len(settled) * (1 - 1 / EXPLORE_EVERY) - 1
    assert choice.describe()[str(matched)]["drafts_by"] == ("lookup" if best else "pool")


def test_the_slower_arm_is_still_measured_and_a_change_of_speeds_is_followed():
    choice = HybridChoice(min_ngram=2)
    first = run(choice, 3, {True: 300.0, False: 100.0}, 200)
    assert 0 < first[4 * MIN_SAMPLES:].count(False) <= 200 // EXPLORE_EVERY
    # the text stops repeating: lookup's rounds yield less than the pool's now
    later = run(choice, 3, {True: 80.0, False: 200.0}, 300)
    assert later[-100:].count(False) >= 100 * (1 - 1 / EXPLORE_EVERY) - 1


def test_each_match_length_keeps_its_own_measure():
    choice = HybridChoice(min_ngram=2)
    run(choice, 1, {True: 100.0, False: 300.0}, 150)
    run(choice, 4, {True: 400.0, False: 300.0}, 150)
    described = choice.describe()
    assert described["1"]["drafts_by"] == "pool" and described["4"]["drafts_by"] == "lookup"
    assert described["2"]["drafts_by"] == "lookup (prior)"
