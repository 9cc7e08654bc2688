"""Choosing k by goodput: the tokens a round yields per millisecond it takes (the idea of
SmartSpec, 2024), so that speculation never costs throughput.

Terms, for the next rounds of this router's adaptive sequences with k drafts each:
- h_i: the chance that the target keeps draft i of a round, given it kept drafts 1..i-1,
  measured on the router's recent rounds: of the rounds that looked at draft i (kept the
  ones before it and drafted at least i), the share that kept it. A single acceptance rate
  alpha for every position would be wrong here: a draft that agreed so far tends to go on
  agreeing (the bundled pair keeps its first draft 67 % of the time and yields 3.4 tokens a
  round at k = 4, where a constant 0.67 predicts 2.2). Beyond the deepest draft observed, h
  is taken as the last observed one.
- E(k): tokens a round yields, 1 + h_1 + h_1 h_2 + ... + h_1 ... h_k (the accepted drafts,
  plus the one token the target adds).
- T(k): a round's time, c(k) + k * d(B_d) + v(B_v, k + 1), where v(R, N) is the target's
  forward pass over R sequences of N new positions each and d(R) one draft step over R
  sequences: a + b * R * N fitted (least squares) to the cost profiles the replicas measure
  at start (replicas/engines/huggingface.py), so that the noise of single measurements does
  not make the choice jump, and scaled by how the last calls compared with them (load,
  contention); B_v and B_d are the batch sizes the calls saw lately, so a full verify batch
  makes every extra position expensive; c(k) is the measured coordination per round (handle
  hops, batch windows, queueing), with a draft hop or without.
- k = argmax over [min_k, max_k] of E(k) / T(k), recomputed every few rounds, and changed
  only when the new k is clearly better (no flapping on noise).

k = 0 is a plain target step: where verifying more positions costs about as much as decoding
them one by one (a compute-bound target, as on this CPU at large batches) E(k) / T(k) falls
with k and speculation turns off; where a verify of k + 1 positions costs about one step (a
memory-bound GPU target), it speculates, further the more drafts are accepted.

One k for all the router's adaptive sequences, not one per sequence: a verify batch whose
rows differ in length runs as several padded groups (replicas/model_runner.py), so mixed k
cost more than they save (measured: 8 streams choosing k each on their own made verify
batches of 4.4 instead of 7.0 and ran 0.9x the target alone).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

_PRIOR_KEEP = 0.7           # h_i before any round looked at draft i
_PRIOR_ROUNDS = 2.0         # the prior counts as this many rounds
_EMA = 0.03                 # weight of a new observation: about the last 30 rounds count
_KEEP_CAP = 0.98
_DECIDE_EVERY_ROUNDS = 16
_SWITCH_GAIN = 1.05         # a new k must promise 5 % more goodput than the current one
# Overlap on or off (OverlapChoice), in rounds of the router's sequences:
_OVERLAP_DECIDE_EVERY = 64   # one stream's rounds vary 2-3x (hits, misses): decide on many
_OVERLAP_SETTLE = 8         # rounds after a switch that still carry the other mode's lookaheads
_OVERLAP_STALE = 512        # a mode not run for this long is run again (probed): load changes
_OVERLAP_DECAY = 1 / 64


class Ema:
    def __init__(self, value: float | None = None, weight: float = _EMA):
        self.value, self.weight = value, weight

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass(frozen=True)
class CostProfile:
    """A forward pass over R sequences of N new positions each takes fixed_ms + per_position_ms
    * R * N, fitted to a replica's measured table (ms[i][j] for rows[i] and positions[j])."""
    fixed_ms: float
    per_position_ms: float

    @classmethod
    def from_describe(cls, state: dict) -> "CostProfile":
        profile = state["cost_profile_ms"]
        points = [(rows * positions, ms) for rows, line in zip(profile["rows"], profile["ms"])
                  for positions, ms in zip(profile["positions"], line)]
        return cls.fit(points)

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "CostProfile":
        """Least squares over (positions in the pass, ms); neither part below zero."""
        n = len(points)
        mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
        slope = max(slope, 0.0)
        return cls(max(mean_y - slope * mean_x, 0.0), slope)

    def forward_ms(self, rows: float, positions: float) -> float:
        return self.fixed_ms + self.per_position_ms * rows * positions


class OverlapChoice:
    """Whether the router's sequences with `speculation.overlap: auto` draft ahead
    (router/lookahead.py): the mode whose recent rounds yielded more tokens per millisecond
    of round wall time.

    Overlap pays when the draft pool would idle during verifies (few sequences, pools on
    their own hardware) and costs when lookaheads, most of them missed, queue before the
    drafts a round waits for or take cores from the target (docs/BENCHMARKS.md: +8-13 % at 1
    client, -30 % at 8 on the 2-core CPU). No cost model predicts that contention well, so
    both modes are measured: goodput_m = decayed sum of tokens / decayed sum of round ms over
    mode m's rounds. Every _OVERLAP_DECIDE_EVERY rounds the mode in use changes when the other
    promised _SWITCH_GAIN more, or when the other's measure is older than _OVERLAP_STALE
    rounds (then it is run again, from scratch, to see whether the load changed). A measure
    taken under another load can mislead one decision; the next corrects it, since the mode
    then runs is measured afresh. The first _OVERLAP_SETTLE rounds after a switch are not
    counted: they finish the old mode's work. Probing costs about 64 of every 576 rounds in
    the worse mode.

    Measured on the 2-core CPU (docs/BENCHMARKS.md): at 8 clients it settles on off; at one
    client the two modes differ by less than its measure's noise (prefill rounds, hits and
    misses), so it may settle on either, and `speculation.overlap` is off by default."""

    def __init__(self, start: bool = True):
        self.on = start
        self.tokens = {True: 0.0, False: 0.0}
        self.ms = {True: 0.0, False: 0.0}
        self.age = {True: math.inf, False: math.inf}   # rounds since a mode was last measured
        self.switches = 0
        self._settling = 0
        self._rounds_since_decision = 0

    def goodput(self, mode: bool) -> float | None:
        """Tokens per ms of mode's measured rounds; None before any."""
        return self.tokens[mode] / self.ms[mode] if self.ms[mode] > 0 else None

    def observe(self, mode: bool, tokens: int, round_ms: float, decides: bool = True) -> None:
        """A finished round with drafts, run with overlap `mode` (a request's first round too:
        where lookaheads fill the pools, prefills wait); rounds of requests that fixed overlap
        measure too, only `decides` rounds move the choice."""
        if self._settling > 0:
            self._settling -= 1
        elif round_ms > 0:
            self.tokens[mode] = (1 - _OVERLAP_DECAY) * self.tokens[mode] + tokens
            self.ms[mode] = (1 - _OVERLAP_DECAY) * self.ms[mode] + round_ms
            self.age[mode] = 0
        self.age[not mode] += 1
        self._rounds_since_decision += decides
        if self._rounds_since_decision >= _OVERLAP_DECIDE_EVERY:
            self._decide()

    def _decide(self) -> None:
        self._rounds_since_decision = 0
        other = not self.on
        now, alternative = self.goodput(self.on), self.goodput(other)
        if self.age[other] > _OVERLAP_STALE:
            self.tokens[other] = self.ms[other] = 0.0          # probe: measure it afresh
            self._switch(other)
        elif now is not None and alternative is not None and alternative > _SWITCH_GAIN * now:
            self._switch(other)

    def _switch(self, mode: bool) -> None:
        self.on, self._settling = mode, _OVERLAP_SETTLE
        self.switches += 1

    def describe(self) -> dict:
        return {"on": self.on, "switches": self.switches,
                "tokens_per_s": {"on": _per_s(self.goodput(True)), "off": _per_s(self.goodput(False))}}


def _per_s(per_ms: float | None) -> float | None:
    return None if per_ms is None else round(per_ms * 1000, 2)


class GoodputController:
    def __init__(self, min_k: int, max_k: int, start_k: int):
        self.min_k, self.max_k = min_k, max_k
        self.k = start_k                                              # what adaptive rounds use now
        self.overlap = OverlapChoice()                                # what "auto" overlap rounds do now
        self.profiles: dict[str, CostProfile] = {}
        self.looked = [0.0] * (max_k + 1)      # decayed counts of rounds that looked at draft i
        self.kept = [0.0] * (max_k + 1)        # ... and kept it
        self.verify_rows, self.draft_rows = Ema(), Ema()
        self.slowdown = {"draft": Ema(1.0), "target": Ema(1.0)}     # observed / profiled time
        self.coordination = {True: Ema(), False: Ema()}               # ms per round, with / without drafts
        self.changes = 0
        self._rounds_since_decision = 0

    @property
    def ready(self) -> bool:
        return "draft" in self.profiles and "target" in self.profiles

    def choose(self, cap: int) -> int:
        return min(self.k, cap)

    def keep_chances(self) -> list[float]:
        """h_1..h_max_k; a position never looked at takes the one before it."""
        chances, before = [], _PRIOR_KEEP
        for i in range(1, self.max_k + 1):
            h = (self.kept[i] + _PRIOR_ROUNDS * before) / (self.looked[i] + _PRIOR_ROUNDS)
            before = min(max(h, 0.0), _KEEP_CAP)
            chances.append(before)
        return chances

    def expected_tokens(self, k: int) -> float:
        total, all_kept = 1.0, 1.0
        for h in self.keep_chances()[:k]:
            all_kept *= h
            total += all_kept
        return total

    def round_ms(self, k: int) -> float:
        verify_rows, draft_rows = self.verify_rows.get(1.0), self.draft_rows.get(self.verify_rows.get(1.0))
        verify = self.slowdown["target"].get(1.0) * self.profiles["target"].forward_ms(verify_rows, k + 1)
        draft = k * self.slowdown["draft"].get(1.0) * self.profiles["draft"].forward_ms(draft_rows, 1) if k else 0.0
        plain, speculative = self.coordination[False].value, self.coordination[True].value
        # Until both kinds of round were seen, one estimates the other: a draft hop about
        # doubles the hops of a round.
        plain = plain if plain is not None else (speculative / 2 if speculative is not None else 5.0)
        speculative = speculative if speculative is not None else 2 * plain
        return (speculative if k else plain) + draft + verify

    def goodput(self, k: int) -> float:
        """Expected tokens per millisecond of a round with k drafts."""
        return self.expected_tokens(k) / self.round_ms(k)

    def observe(self, k: int, accepted: int, round_ms: float, verification, proposal,
                adaptive: bool = True) -> None:
        """Learn from a finished round that drafted k and kept `accepted` (any round: fixed k
        and target-only rounds measure the same pools); only adaptive rounds move the decision."""
        if k:
            self._count_kept(k, accepted)
        self.verify_rows.add(verification.batch_rows)
        model_ms = verification.model_ms
        if proposal is not None:
            self.draft_rows.add(proposal.batch_rows)
            model_ms += proposal.model_ms
            self._observe_slowdown("draft", proposal.model_ms, max(proposal.steps, 1), proposal.batch_rows, 1)
        rows = max(verification.batch_rows, 1)
        self._observe_slowdown("target", verification.model_ms, 1, rows,
                               max(verification.batch_positions, rows) / rows)
        self.coordination[bool(k)].add(max(round_ms - model_ms, 0.0))
        self._rounds_since_decision += adaptive
        if self.ready and self._rounds_since_decision >= _DECIDE_EVERY_ROUNDS:
            self._decide()

    def _count_kept(self, k: int, accepted: int) -> None:
        for i in range(1, self.max_k + 1):
            self.looked[i] *= 1 - _EMA
            self.kept[i] *= 1 - _EMA
        for i in range(1, min(k, self.max_k) + 1):
            if accepted >= i - 1:
                self.looked[i] += 1
                self.kept[i] += accepted >= i

    def describe(self) -> dict:
        table = {k: round(self.goodput(k) * 1000, 2) for k in range(self.min_k, self.max_k + 1)} if self.ready else {}
        return {"k": self.k, "changes": self.changes, "keep_chances": [round(h, 3) for h in self.keep_chances()],
                "verify_rows": round(self.verify_rows.get(1.0), 2), "draft_rows": round(self.draft_rows.get(1.0), 2),
                "coordination_ms": {"with_drafts": self.coordination[True].value,
                                    "without": self.coordination[False].value},
                "slowdown": {pool: round(ema.get(1.0), 3) for pool, ema in self.slowdown.items()},
                "profiles": {pool: vars(profile) for pool, profile in self.profiles.items()},
                "tokens_per_s_by_k": table, "overlap": self.overlap.describe(), "when": time.time()}

    def _decide(self) -> None:
        self._rounds_since_decision = 0
        best = max(range(self.min_k, self.max_k + 1), key=self.goodput)
        if best != self.k and self.goodput(best) > _SWITCH_GAIN * self.goodput(min(max(self.k, self.min_k), self.max_k)):
            self.k = best
            self.changes += 1

    def _observe_slowdown(self, pool: str, observed_ms: float, passes: int, rows: float, positions: float) -> None:
        profile = self.profiles.get(pool)
        if profile is None:
            return
        expected = passes * profile.forward_ms(rows, positions)
        if expected > 0 and math.isfinite(observed_ms):
            self.slowdown[pool].add(min(max(observed_ms / expected, 0.25), 8.0))
