"""Where a round's drafts come from: one part per kind, in a table by the request's method.

Each part makes a sequence's offer for a round (router/k_control.py): the lookup drafts it
can verify at no cost (made here, in the router, from tokens it holds) and whether the draft
pool may draft for it. The controller then picks the source and k; drafts from the pool are
asked for after that choice (router/speculation.py).

- draft_model: the draft pool; while the pool is unavailable (router/fallback.py), prompt
  lookup instead where lookup_fallback is on.
- ngram: prompt lookup in the sequence (replicas/drafting/lookup.py).
- suffix: lookup in the sequence and in the router's recent outputs (replicas/drafting/suffix.py).
- hybrid: prompt lookup where a match of hybrid_min_ngram tokens or more was found, and the
  draft pool: whichever the controller prices higher, round by round.

Exactness: a lookup draft is a function of state fixed before the round, so its q is one-hot
and the acceptance rule keeps the target's distribution; pool drafts carry their q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from router.k_control import POOL, Offer
from replicas.drafting.lookup import LookupOptions, lookup_match
from replicas.drafting.suffix import OutputCache, suffix_match


@dataclass
class DraftSources:
    lookup: LookupOptions
    outputs: OutputCache | None          # finished outputs for suffix drafts, or None

    def offer(self, method: str, tokens: list[int], limit: int, pool: bool,
              may: Callable[[str], bool] = lambda source: True) -> Offer:
        """Sequence `tokens`' offer for a round of at most `limit` drafts; `pool`: the draft
        pool is there and answering; `may(source)`: whether that source's drafts could pay
        this round at all (router/k_control.py): a lookup that could not is not made."""
        if limit <= 0:
            return Offer()
        return _OFFERS[method](self, tokens, limit, pool, may)

    def fallback(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Drafts for a round whose pool call failed or came late: prompt lookup, where the
        server serves it; else none (the target alone)."""
        return lookup_match(tokens, k) if self.lookup.fallback else ([], 0)


def _pool(sources: DraftSources, tokens: list[int], limit: int, pool: bool, may) -> Offer:
    if pool:
        return Offer(pool=True)
    drafts, match = sources.fallback(tokens, limit) if may("ngram") else ([], 0)
    return Offer(tuple(drafts), "ngram" if drafts else None, match, fallback=True)


def _ngram(sources: DraftSources, tokens: list[int], limit: int, pool: bool, may) -> Offer:
    if not may("ngram"):
        return Offer()
    drafts, match = lookup_match(tokens, limit)
    return Offer(tuple(drafts), "ngram", match)


def _suffix(sources: DraftSources, tokens: list[int], limit: int, pool: bool, may) -> Offer:
    if not may("suffix"):
        return Offer()
    drafts, match = suffix_match(tokens, limit, sources.outputs)
    return Offer(tuple(drafts), "suffix", match)


def _hybrid(sources: DraftSources, tokens: list[int], limit: int, pool: bool, may) -> Offer:
    drafts, match = lookup_match(tokens, limit) if may("ngram") else ([], 0)
    if match < sources.lookup.hybrid_min_ngram:
        drafts, match = [], 0
    if not pool and not drafts:
        return _pool(sources, tokens, limit, pool, may)
    return Offer(tuple(drafts), "ngram" if drafts else None, match, pool)


_OFFERS: dict[str, Callable[..., Offer]] = {
    "draft_model": _pool, "ngram": _ngram, "suffix": _suffix, "hybrid": _hybrid}
METHODS = tuple(_OFFERS)


def fixed_source(offer: Offer) -> str | None:
    """Where a round whose request fixed k takes its drafts: lookup where the offer has a
    match (hybrid's rule: a match first), else the pool where it may draft."""
    if offer.lookup:
        return offer.lookup_source
    return POOL if offer.pool else None
