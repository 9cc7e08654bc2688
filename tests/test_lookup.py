"""Prompt lookup drafts (replicas/drafting/lookup.py), against a brute-force reference written apart."""

from __future__ import annotations

import random

import pytest

from replicas.drafting.lookup import lookup_drafts


def reference(tokens: list[int], k: int, max_ngram: int = 4) -> list[int]:
    """Every suffix length from the longest, every earlier start from the latest: the first hit."""
    for n in range(max_ngram, 0, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            start = max(starts)
            return tokens[start + n:start + n + k]
    return []


def test_the_longest_suffix_wins_over_a_nearer_shorter_one():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 9, 7, 3, 1, 2, 3]
    # "1 2 3" occurs at 1..3 (then 9 9 7); "3" alone occurs later, at 7 (then 1 2)
    assert lookup_drafts(tokens, 3) == [9, 9, 7]


def test_the_latest_earlier_occurrence_is_copied():
    tokens = [4, 1, 8, 4, 1, 6, 4, 1]
    assert lookup_drafts(tokens, 2) == [6, 4]


def test_no_match_and_no_room_give_no_drafts():
    assert lookup_drafts([1, 2, 3, 4], 4) == []
    assert lookup_drafts([7], 4) == []
    assert lookup_drafts([1, 2, 1, 2], 0) == []
    # the continuation stops where the sequence does
    assert lookup_drafts([3, 5, 3], 6) == [5, 3]


@pytest.mark.parametrize("seed", range(40))
def test_it_equals_the_brute_force_reference(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4 if seed % 2 else 12) for _ in range(rng.randrange(1, 60))]
    k = rng.randrange(1, 9)
    assert lookup_drafts(tokens, k) == reference(tokens, k)
