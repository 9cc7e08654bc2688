"""Suffix drafting (`speculation.method: suffix`): drafts from the sequence's own tokens and
from the recent outputs of other requests, as SuffixDecoding does (Oliaro et al., 2024:
agentic and repetitive workloads repeat what earlier requests wrote).

Terms:
- depth: the longest context (in tokens) a match looks at; a longer match predicts better.
- output cache: the last tokens (at most `max_tokens` in all) of the router's finished
  requests, each an output with the `depth` prompt tokens before it, oldest evicted first.
  Indexed by every n-gram of 1..depth tokens to how often each next token followed it (a
  suffix tree's node counts, flattened: memory is depth entries a cached token at most).
- a round's drafts: the longer match of two, the sequence's own tokens (prompt lookup,
  replicas/drafting/lookup.py, up to `depth` tokens) or the output cache (a walk: each draft the most
  frequent next token after the longest context it knows, while the drafts' estimated
  chance of all being right, the product of their shares of the counts, stays at least
  `min_chance`); the sequence's own match where both are as long.

Exactness: as for prompt lookup, a draft is a function of state fixed before the round (the
context and the cache), so q is one-hot at it and the acceptance rule keeps the target's
distribution; greedy keeps drafts while they are the target's argmax.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from replicas.drafting.lookup import lookup_match

DEPTH = 8
MIN_CHANCE = 0.1         # SuffixDecoding stops a path where its estimated chance drops below about this


class OutputCache:
    """Recent outputs, bounded in tokens (oldest first out), indexed by n-grams."""

    def __init__(self, max_tokens: int, depth: int = DEPTH):
        self.max_tokens = max_tokens
        self.depth = depth
        self.tokens = 0                                    # tokens held, over all entries
        self._entries: deque[tuple[int, ...]] = deque()
        self._next: dict[tuple[int, ...], Counter[int]] = {}   # n-gram -> counts of the token after it

    @property
    def index_size(self) -> int:
        """N-grams indexed (at most depth per token held)."""
        return len(self._next)

    def describe(self) -> dict:
        return {"tokens": self.tokens, "max_tokens": self.max_tokens, "outputs": len(self._entries),
                "index_size": self.index_size, "depth": self.depth}

    def add(self, lead_in: Sequence[int], output: Sequence[int]) -> None:
        """An output, with the prompt tokens before it (its last `depth` are kept: the
        contexts the output's first tokens followed)."""
        entry = tuple(lead_in[max(len(lead_in) - self.depth, 0):]) + tuple(output)
        entry = entry[max(len(entry) - self.max_tokens, 0):]
        if len(entry) < 2:
            return
        self._entries.append(entry)
        self.tokens += len(entry)
        self._count(entry, +1)
        while self.tokens > self.max_tokens:
            oldest = self._entries.popleft()
            self.tokens -= len(oldest)
            self._count(oldest, -1)

    def _count(self, entry: tuple[int, ...], step: int) -> None:
        for end in range(1, len(entry)):
            follower = entry[end]
            for n in range(1, min(self.depth, end) + 1):
                key = entry[end - n:end]
                counts = self._next.get(key)
                if counts is None:
                    counts = self._next[key] = Counter()
                counts[follower] += step
                if counts[follower] <= 0:
                    del counts[follower]
                    if not counts:
                        del self._next[key]

    def walk(self, context: Sequence[int], k: int, min_chance: float = MIN_CHANCE) -> tuple[list[int], int]:
        """Up to k drafts after `context`, and the length of the context the first one was
        matched on (0: none known)."""
        drafts: list[int] = []
        window = list(context[max(len(context) - self.depth, 0):])
        chance, first_match = 1.0, 0
        while len(drafts) < k:
            found = self._longest(window)
            if found is None:
                break
            matched, counts = found
            token, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
            chance *= count / sum(counts.values())
            if chance < min_chance:
                break
            first_match = first_match or matched
            drafts.append(token)
            window = (window + [token])[-self.depth:]
        return drafts, first_match

    def _longest(self, window: list[int]) -> tuple[int, Counter[int]] | None:
        for n in range(len(window), 0, -1):
            counts = self._next.get(tuple(window[len(window) - n:]))
            if counts:
                return n, counts
        return None


def suffix_drafts(tokens: list[int], k: int, cache: OutputCache | None) -> list[int]:
    """Up to k drafts for what follows `tokens`: the sequence's own longest earlier match or
    the output cache's, whichever matched the longer context (the sequence's own on a tie)."""
    return suffix_match(tokens, k, cache)[0]


def suffix_match(tokens: list[int], k: int, cache: OutputCache | None) -> tuple[list[int], int]:
    """suffix_drafts' drafts, and the length of the context they were matched on (0: none)."""
    if k <= 0:
        return [], 0
    depth = cache.depth if cache is not None else DEPTH
    own, own_match = lookup_match(tokens, k, max_ngram=depth)
    if cache is None:
        return own, own_match
    shared, shared_match = cache.walk(tokens, k)
    return (shared, shared_match) if shared_match > own_match else (own, own_match)
