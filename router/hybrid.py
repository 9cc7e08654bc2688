"""Hybrid drafting's per-round choice by measured goodput (`speculation.method: hybrid`):
lookup drafts where the sequence's own match has yielded more tokens per second than the
draft pool's drafts, the draft pool elsewhere.

Terms:
- match length n: the longest suffix of the sequence, 1..MAX_NGRAM tokens, that occurred
  earlier in it (router/lookup.py); 0 when none did, and then the draft pool drafts.
- arm: at match length n, "lookup" (its continuation as drafts, no draft call) or "pool"
  (the draft pool's model, at the k its own measured choice gives, 0 included).
- goodput of an arm: the tokens its rounds yielded (drafts kept plus the target's own) over
  the rounds' wall time at the router, both as exponential moving averages. Rounds of both
  arms run at once, in the same batches, so one arm's round time against the other's is what
  a draft call costs beside what it brings; a longer match copies more text that will recur,
  which is why each n keeps its own pair of arms.

Rule: at match length n the arm of higher goodput drafts. Until both arms of n have
MIN_SAMPLES rounds, the prior decides: lookup where n >= speculation.hybrid_min_ngram (what
hybrid did before it measured). Every EXPLORE_EVERY-th round at n goes to the arm not chosen (and
every other round while that arm has fewer than MIN_SAMPLES), so that a slower arm is measured
again when the load or the text changes: the cost of measuring, 1/16 of the rounds once both
arms are known.

Exactness: the choice only says where a round's drafts come from; either way the target's
rule verifies them (lookup drafts as one-hot q), so output is the target's whatever is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.goodput import Ema
from router.lookup import MAX_NGRAM

MIN_SAMPLES = 8
EXPLORE_EVERY = 16
_SMOOTHING = 0.1          # an EMA's weight of the newest round


@dataclass
class _Arm:
    tokens: Ema = field(default_factory=lambda: Ema(weight=_SMOOTHING))
    seconds: Ema = field(default_factory=lambda: Ema(weight=_SMOOTHING))
    rounds: int = 0

    def goodput(self) -> float:
        """Tokens per second of its rounds; 0 before its first."""
        seconds = self.seconds.get(0.0)
        return self.tokens.get(0.0) / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class HybridArm:
    """What a hybrid round ran: its match length and whether it drafted by lookup."""
    matched: int
    lookup: bool


class HybridChoice:
    def __init__(self, min_ngram: int):
        self.min_ngram = min_ngram
        self._arms = {(n, lookup): _Arm() for n in range(1, MAX_NGRAM + 1) for lookup in (True, False)}
        self._rounds_at = {n: 0 for n in range(1, MAX_NGRAM + 1)}

    def choose(self, matched: int) -> HybridArm:
        """The arm of a round whose sequence's longest earlier match is `matched` tokens."""
        if matched <= 0:
            return HybridArm(0, False)
        n = min(matched, MAX_NGRAM)
        self._rounds_at[n] += 1
        lookup, pool = self._arms[(n, True)], self._arms[(n, False)]
        if min(lookup.rounds, pool.rounds) < MIN_SAMPLES:
            preferred = n >= self.min_ngram
        else:
            preferred = lookup.goodput() >= pool.goodput()
        # the other arm: every EXPLORE_EVERY-th round, and every other round until it has its samples
        count, other = self._rounds_at[n], self._arms[(n, not preferred)]
        explore = count % EXPLORE_EVERY == 0 or (other.rounds < MIN_SAMPLES and count % 2 == 0)
        return HybridArm(n, preferred != explore)

    def observe(self, arm: HybridArm, tokens: int, seconds: float) -> None:
        """A finished hybrid round: the tokens it yielded and its wall time at the router."""
        if arm.matched <= 0 or seconds <= 0:
            return
        measured = self._arms[(arm.matched, arm.lookup)]
        measured.tokens.add(tokens)
        measured.seconds.add(seconds)
        measured.rounds += 1

    def describe(self) -> dict:
        """Per match length: each arm's rounds and goodput (tokens/s), and which drafts now."""
        out = {}
        for n in range(1, MAX_NGRAM + 1):
            lookup, pool = self._arms[(n, True)], self._arms[(n, False)]
            measured = min(lookup.rounds, pool.rounds) >= MIN_SAMPLES
            out[str(n)] = {"lookup_rounds": lookup.rounds, "lookup_tokens_per_s": round(lookup.goodput(), 1),
                           "pool_rounds": pool.rounds, "pool_tokens_per_s": round(pool.goodput(), 1),
                           "drafts_by": ("lookup" if lookup.goodput() >= pool.goodput() else "pool") if measured
                           else ("lookup" if n >= self.min_ngram else "pool") + " (prior)"}
        return out
