"""What a round with k drafts should yield: keep chances, pooled and per sequence.

Terms:
- h_j: the chance that the target keeps draft j of a round, given it kept drafts 1..j-1:
  of the rounds that looked at draft j (kept the ones before it and drafted at least j), the
  share that kept it. A single acceptance rate for every position would be wrong: a draft
  that agreed so far tends to go on agreeing (the bundled pair keeps its first draft 67 % of
  the time and yields 3.4 tokens a round at k = 4, where a constant 0.67 predicts 2.2).
- E(k): tokens a round's window yields, 1 + h_1 + h_1 h_2 + ... + h_1 ... h_k (the kept
  drafts, plus the one token the target adds).
- pooled chances (KeepChances): over all of a router's rounds of one draft source (the draft
  pool's model; lookup drafts by method and by the length of the match they came from, which
  predicts them best). They are the prior of each sequence's own.
- a sequence's chances (SequenceKeep): its own rounds' counts, forgotten round by round
  (drafting or not), with the pooled chances counted as a few rounds of evidence. A
  sequence whose drafts keep failing stops drafting without moving its neighbours' choice;
  one that stopped drifts back to the pooled chances as its own evidence fades, so it is
  tried again now and then.
- gain calibration (GainCalibration): of the drafts the controller chose, how many the target
  kept against how many the chances said it would, per source and draft position. The
  chances a choice is made with are raised (optimism) and chosen where they look best, so
  they overstate what the chosen drafts keep (the winner's curse): on a running default
  cluster (2026-12-06) sampled suffix rounds kept 63 % of what their chances expected at 16
  clients, 84 % at one, and the batch paid for drafts that bought less than their time. The
  controller scales each position's expected gain by its measured share.
"""

from __future__ import annotations

import math

_PRIOR_KEEP = 0.7           # h_j before any round looked at draft j
_PRIOR_ROUNDS = 2.0         # the pooled prior of a position counts as this many rounds
_KEEP_DECAY = 0.01          # pooled, per round observed: about the last 100 rounds count
_KEEP_CAP = 0.98
_EFFECTIVE = 2.0            # a decayed count's effective sample size, per unit: (1 + r) / (1 - r) over 1 / (1 - r)
_SEQUENCE_PRIOR_ROUNDS = 2.0   # a sequence's prior (the pooled chances) counts as this many of its rounds
_SEQUENCE_DECAY = 0.95         # per round of the sequence: its last twenty or so rounds count
_CALIBRATION_PRIOR = 4.0       # expected and kept drafts a fresh calibration starts from (share 1)
_CALIBRATION_DECAY = 0.98      # per drafting round: about the last fifty rounds count


def expected_tokens(chances: list[float], k: int) -> float:
    total, all_kept = 1.0, 1.0
    for h in chances[:k]:
        all_kept *= h
        total += all_kept
    return total


def expected_curve(chances: list[float]) -> list[float]:
    """E(0), E(1), ..., E(len(chances))."""
    curve, all_kept = [1.0], 1.0
    for h in chances:
        all_kept *= h
        curve.append(curve[-1] + all_kept)
    return curve


class KeepChances:
    """h_1..h_max_k, from decayed counts of the rounds that looked at draft j and kept it."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.looked = [0.0] * (max_k + 1)
        self.kept = [0.0] * (max_k + 1)
        self._chances: list[float] | None = None
        self._optimistic: list[float] | None = None

    def observe(self, drafted: int, accepted: int) -> None:
        for j in range(1, self.max_k + 1):
            self.looked[j] *= 1 - _KEEP_DECAY
            self.kept[j] *= 1 - _KEEP_DECAY
        _count(self.looked, self.kept, drafted, accepted)
        self._chances = self._optimistic = None

    def chances(self) -> list[float]:
        """h_1..h_max_k; a position never looked at takes the one before it."""
        if self._chances is None:
            out, before = [], _PRIOR_KEEP
            for j in range(1, self.max_k + 1):
                before = _bounded((self.kept[j] + _PRIOR_ROUNDS * before) / (self.looked[j] + _PRIOR_ROUNDS))
                out.append(before)
            self._chances = out
        return self._chances

    def optimistic(self) -> list[float]:
        """h_j raised by one standard error (its share's, from the rounds that looked at it):
        what the choice prices drafts with. Chances measured on few rounds are given the
        benefit of the doubt, so that drafting that looked bad on a handful of rounds is tried
        again and measured, rather than left unseen (optimism under uncertainty); on hundreds
        of rounds the raise is a few hundredths."""
        if self._optimistic is None:
            self._optimistic = [_bounded(h + math.sqrt(h * (1 - h) / (_EFFECTIVE * self.looked[j] + _PRIOR_ROUNDS)))
                                for j, h in enumerate(self.chances(), start=1)]
        return self._optimistic

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.chances(), k)

    def relative_variance(self, k: int) -> float:
        """Var(E(k)) / E(k)^2 by the delta method: h_j as a binomial share of the rounds that
        looked at draft j, counted as twice their decayed count (the effective sample size of
        geometric weights). dE/dh_j = h_1 ... h_(j-1) (1 + h_(j+1) + h_(j+1) h_(j+2) + ...)."""
        h = self.chances()[:k]
        total = 0.0
        for i in range(k):
            before = math.prod(h[:i])
            after, run = 1.0, 1.0
            for later in h[i + 1:]:
                run *= later
                after += run
            samples = _EFFECTIVE * self.looked[i + 1] + _PRIOR_ROUNDS
            total += (before * after) ** 2 * h[i] * (1 - h[i]) / samples
        return total / self.expected_tokens(k) ** 2


class SequenceKeep:
    """One sequence's own h_1..h_max_k: its recent rounds, with the pooled chances as prior."""

    __slots__ = ("looked", "kept")

    def __init__(self, max_k: int):
        self.looked = [0.0] * (max_k + 1)
        self.kept = [0.0] * (max_k + 1)

    def observe(self, drafted: int, accepted: int) -> None:
        """A round of this sequence (drafted 0: it verified no drafts; its evidence still fades)."""
        for j in range(1, len(self.looked)):
            self.looked[j] *= _SEQUENCE_DECAY
            self.kept[j] *= _SEQUENCE_DECAY
        _count(self.looked, self.kept, drafted, accepted)

    def chances(self, prior: list[float]) -> list[float]:
        return [_bounded((self.kept[j] + _SEQUENCE_PRIOR_ROUNDS * h) / (self.looked[j] + _SEQUENCE_PRIOR_ROUNDS))
                for j, h in enumerate(prior, start=1)]

    def first_chance(self, prior: float) -> float:
        """h_1 with `prior` as the pooled first chance."""
        return _bounded((self.kept[1] + _SEQUENCE_PRIOR_ROUNDS * prior) / (self.looked[1] + _SEQUENCE_PRIOR_ROUNDS))

    def evidence(self) -> float:
        """Rounds' worth of its own evidence on the first draft."""
        return self.looked[1]


class GainCalibration:
    """Per draft position j: how often the chosen rounds kept draft j against how often their
    chances said they would (the sum of P(draft j kept) over the rounds that drafted j), with
    forgetting. A position's share is at most 1 and at most the share before it: the
    optimism in each chance compounds down the window."""

    __slots__ = ("expected", "kept", "_shares")

    def __init__(self, max_k: int):
        self.expected = [_CALIBRATION_PRIOR] * (max_k + 1)
        self.kept = [_CALIBRATION_PRIOR] * (max_k + 1)
        self._shares: list[float] | None = None     # shares() until the next observe

    def observe(self, expected: list[float], accepted: int) -> None:
        """A chosen round: P(draft j kept) for its drafts j = 1..k as expected, and the drafts
        kept. Every position fades towards the prior (share 1), those the round drafted
        included: a position no round drafts any more (after acceptance fell, say) must not
        keep the share it had then once acceptance is back."""
        refill = (1 - _CALIBRATION_DECAY) * _CALIBRATION_PRIOR
        for j in range(1, len(self.expected)):
            drafted = j <= len(expected)
            self.expected[j] = _CALIBRATION_DECAY * self.expected[j] + refill + (expected[j - 1] if drafted else 0.0)
            self.kept[j] = _CALIBRATION_DECAY * self.kept[j] + refill + (drafted and accepted >= j)
        self._shares = None

    def shares(self) -> list[float]:
        """s_1..s_max_k: the share of its expected kept drafts position j kept."""
        if self._shares is None:
            out, before = [], 1.0
            for j in range(1, len(self.expected)):
                before = min(before, self.kept[j] / self.expected[j])
                out.append(before)
            self._shares = out
        return self._shares


def _count(looked: list[float], kept: list[float], drafted: int, accepted: int) -> None:
    for j in range(1, min(drafted, len(looked) - 1) + 1):
        if accepted >= j - 1:
            looked[j] += 1
            kept[j] += accepted >= j


def _bounded(h: float) -> float:
    return min(max(h, 0.0), _KEEP_CAP)
