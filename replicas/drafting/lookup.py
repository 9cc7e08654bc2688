"""Prompt lookup: drafts copied from the sequence itself (`speculation.method: ngram`).

The sequence's last n tokens (n from max_ngram down to min_ngram, the longest that matches
first) are looked for earlier in the sequence, prompt and output alike; the k tokens that
followed their latest earlier occurrence are the drafts. Code that is edited, quoted or
repeated is copied this way at no cost: no draft model, no call, no hop, since the router
holds every sequence's tokens.

Exactness: a lookup draft is a function of the context, so its distribution q is one-hot at
the drafted token. The acceptance rule with that q (replicas/speculative.py: a round sent
without draft_probs is verified as one-hot q) keeps the draft with probability p(x) and
otherwise samples from p with x taken out: the output has exactly the target's distribution;
greedy keeps drafts while they equal the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_NGRAM = 1
MAX_NGRAM = 4


@dataclass(frozen=True)
class LookupOptions:
    """Where the router drafts by lookup besides `method: ngram` requests."""
    k: int = 4                  # drafts a hybrid round takes from a match
    hybrid_min_ngram: int = 2   # a hybrid round drafts by lookup when a suffix this long matched
    fallback: bool = True       # rounds whose draft pool failed or is late draft by lookup


def lookup_drafts(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k drafts for what follows `tokens`: the continuation of the latest earlier
    occurrence of its longest matching suffix of min_ngram..max_ngram tokens; none when no
    suffix occurs earlier (or k is 0)."""
    return lookup_match(tokens, k, max_ngram, min_ngram)[0]


def lookup_match(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> tuple[list[int], int]:
    """lookup_drafts' drafts, and the length of the suffix that matched (0: none)."""
    if k <= 0:
        return [], 0
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[length - n:]
        last = pattern[-1]
        # latest start first: the nearest copy is the likeliest to go on the same way
        for end in range(length - 2, n - 2, -1):     # `end`: where an earlier occurrence ends
            if tokens[end] == last and tokens[end - n + 1:end + 1] == pattern:
                return tokens[end + 1:end + 1 + k], n
    return [], 0
