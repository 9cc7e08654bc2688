"""Suffix drafts (replicas/drafting/suffix.py): the output cache's walk against a brute-force count over
the outputs it holds, its memory bound under a flood of distinct outputs, and the choice
between the sequence's own match and the cache's."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from replicas.drafting.lookup import lookup_match
from replicas.drafting.suffix import DEPTH, MIN_CHANCE, OutputCache, suffix_drafts


def reference_walk(entries: list[tuple[int, ...]], context: list[int], k: int, depth: int) -> list[int]:
    """Each draft: over every held output, the tokens that followed the longest suffix of the
    context (up to depth) that occurs followed by something; the most frequent (lowest id on
    a tie), while the product of the drafts' shares stays at least MIN_CHANCE."""
    drafts, window, chance = [], list(context), 1.0
    while len(drafts) < k:
        followers = Counter()
        for n in range(min(depth, len(window)), 0, -1):
            pattern = tuple(window[-n:])
            followers = Counter(entry[i + n] for entry in entries for i in range(len(entry) - n)
                                if entry[i:i + n] == pattern)
            if followers:
                break
        if not followers:
            break
        token, count = min(followers.items(), key=lambda item: (-item[1], item[0]))
        chance *= count / sum(followers.values())
        if chance < MIN_CHANCE:
            break
        drafts.append(token)
        window.append(token)
    return drafts


@pytest.mark.parametrize("seed", range(30))
def test_the_walk_equals_the_brute_force_count(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    cache = OutputCache(max_tokens=10_000, depth=rng.choice([2, 4, 8]))
    for _ in range(rng.randint(1, 6)):
        cache.add([rng.randrange(vocab) for _ in range(rng.randint(0, 10))],
                  [rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    k = rng.randint(1, 8)
    drafts, matched = cache.walk(context, k)
    assert drafts == reference_walk(list(cache._entries), context, k, cache.depth)
    assert (matched > 0) == bool(drafts)


def test_an_earlier_requests_output_is_drafted_after_the_same_prompt():
    cache = OutputCache(max_tokens=1000)
    prompt, output = [5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]
    cache.add(prompt, output)
    assert suffix_drafts(list(prompt), 5, cache) == output[:5]
    assert suffix_drafts(list(prompt), 5, None) == []            # the sequence alone has no earlier match
    assert suffix_drafts(list(prompt), 0, cache) == []


def test_the_longer_match_wins_and_the_sequence_wins_a_tie():
    cache = OutputCache(max_tokens=1000)
    cache.add([], [1, 2, 3, 4, 50, 51, 52])
    # the sequence's own match of 1 token (4 -> 60) against the cache's of 4 (1 2 3 4 -> 50)
    assert suffix_drafts([4, 60, 61, 1, 2, 3, 4], 3, cache) == [50, 51, 52]
    # both matched 2 tokens (3 4): the sequence's own continuation
    assert suffix_drafts([3, 4, 70, 71, 9, 3, 4], 2, cache) == [70, 71]
    assert suffix_drafts([3, 4, 70, 71, 9, 3, 4], 2, cache) == lookup_match([3, 4, 70, 71, 9, 3, 4], 2, DEPTH)[0]


def test_a_flood_of_distinct_outputs_stays_within_the_cap_and_evicts_whole_outputs():
    cap, depth = 600, 8
    cache = OutputCache(max_tokens=cap, depth=depth)
    rng = random.Random(0)
    first = None
    for i in range(400):
        output = [rng.randrange(5000) for _ in range(rng.randint(10, 70))]
        cache.add([rng.randrange(5000) for _ in range(12)], output)
        first = first or output
        assert cache.tokens <= cap and cache.index_size <= depth * cache.tokens
        assert cache.tokens == sum(len(entry) for entry in cache._entries)
    # what is left is indexed exactly as a fresh cache of the outputs still held
    fresh = OutputCache(max_tokens=cap, depth=depth)
    for entry in cache._entries:
        fresh.add([], entry)
    assert cache._next == fresh._next
    assert cache.walk(first[:depth], 4)[0] != first[depth:depth + 4]   # the oldest is gone
    assert cache.describe()["outputs"] == len(cache._entries) < 400


def test_an_output_longer_than_the_cap_keeps_its_end():
    cache = OutputCache(max_tokens=10, depth=3)
    cache.add([1, 2, 3], list(range(100, 130)))
    assert cache.tokens == 10 and list(cache._entries[0]) == list(range(120, 130))
