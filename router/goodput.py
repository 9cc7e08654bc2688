"""What a round with k drafts should yield: measured keep chances, and a cost model used only
as a prior (router/k_control.py measures, then chooses).

Terms, for the rounds of this router's sequences:
- h_i: the chance that the target keeps draft i of a round, given it kept drafts 1..i-1,
  measured on the router's recent rounds: of the rounds that looked at draft i (kept the
  ones before it and drafted at least i), the share that kept it. A single acceptance rate
  alpha for every position would be wrong here: a draft that agreed so far tends to go on
  agreeing (the bundled pair keeps its first draft 67 % of the time and yields 3.4 tokens a
  round at k = 4, where a constant 0.67 predicts 2.2). Beyond the deepest draft observed, h
  is taken as the last observed one.
- E(k): tokens a round yields, 1 + h_1 + h_1 h_2 + ... + h_1 ... h_k (the accepted drafts,
  plus the one token the target adds). The measured choice uses E(k) rather than each
  window's own token count: h is measured over every round of every k, so E(k) is far less
  noisy than the tokens of the few dozen rounds of one window, and it is the same quantity.
- the prior's T(k): a round's time, c(k) + k * d(R) + v(R, k + 1), where v(R, N) is the
  target's forward pass over R sequences of N new positions each and d(R) one draft step
  over R sequences, a + b * R * N fitted (least squares) to the cost profiles the replicas
  measure at start (replicas/engines/huggingface/engine.py), and c(k) the measured coordination
  per round (handle hops, batch windows, queueing), with a draft hop or without. Its
  argmax over k of E(k) / T(k) is where a load level met for the first time starts; on a
  shared CPU it is wrong in both directions (docs/BENCHMARKS.md), so nothing else uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_PRIOR_KEEP = 0.7           # h_i before any round looked at draft i
_PRIOR_ROUNDS = 2.0         # the prior counts as this many rounds
_KEEP_DECAY = 0.005         # per round: about the last 200 rounds count
_KEEP_CAP = 0.98
_EMA = 0.03


class Ema:
    def __init__(self, value: float | None = None, weight: float = _EMA):
        self.value, self.weight = value, weight

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class KeepChances:
    """h_1..h_max_k, from decayed counts of the rounds that looked at draft i and kept it."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.looked = [0.0] * (max_k + 1)
        self.kept = [0.0] * (max_k + 1)

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(1, self.max_k + 1):
            self.looked[i] *= 1 - _KEEP_DECAY
            self.kept[i] *= 1 - _KEEP_DECAY
        for i in range(1, min(drafted, self.max_k) + 1):
            if accepted >= i - 1:
                self.looked[i] += 1
                self.kept[i] += accepted >= i

    def chances(self) -> list[float]:
        """h_1..h_max_k; a position never looked at takes the one before it."""
        out, before = [], _PRIOR_KEEP
        for i in range(1, self.max_k + 1):
            h = (self.kept[i] + _PRIOR_ROUNDS * before) / (self.looked[i] + _PRIOR_ROUNDS)
            before = min(max(h, 0.0), _KEEP_CAP)
            out.append(before)
        return out

    def expected_tokens(self, k: int) -> float:
        total, all_kept = 1.0, 1.0
        for h in self.chances()[:k]:
            all_kept *= h
            total += all_kept
        return total

    def relative_variance(self, k: int) -> float:
        """Var(E(k)) / E(k)^2 by the delta method: h_i as a binomial share of the rounds that
        looked at draft i, counted as twice their decayed count (the effective sample size of
        geometric weights: (sum w)^2 / sum w^2 = (1 + r) / (1 - r) against sum w = 1 / (1 - r)).
        dE/dh_i = h_1 ... h_(i-1) (1 + h_(i+1) + h_(i+1) h_(i+2) + ... )."""
        h = self.chances()[:k]
        total = 0.0
        for i in range(k):
            before = math.prod(h[:i])
            after, run = 1.0, 1.0
            for later in h[i + 1:]:
                run *= later
                after += run
            samples = 2 * self.looked[i + 1] + _PRIOR_ROUNDS
            total += (before * after) ** 2 * h[i] * (1 - h[i]) / samples
        return total / self.expected_tokens(k) ** 2


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


@dataclass
class CostModel:
    """The prior: the k the replicas' start-up profiles predict is best at a load."""
    keep: KeepChances
    profiles: dict[str, CostProfile] = field(default_factory=dict)
    coordination: dict[bool, Ema] = field(default_factory=lambda: {True: Ema(), False: Ema()})

    @property
    def ready(self) -> bool:
        return "draft" in self.profiles and "target" in self.profiles

    def observe(self, drafted: bool, round_ms: float, model_ms: float) -> None:
        """A round's coordination: its wall time outside the engines."""
        self.coordination[drafted].add(max(round_ms - model_ms, 0.0))

    def round_ms(self, k: int, rows: float) -> float:
        verify = self.profiles["target"].forward_ms(rows, k + 1)
        draft = k * self.profiles["draft"].forward_ms(rows, 1) if k else 0.0
        plain, speculative = self.coordination[False].value, self.coordination[True].value
        # Until both kinds of round were seen, one estimates the other: a draft hop about
        # doubles the hops of a round.
        plain = plain if plain is not None else (speculative / 2 if speculative is not None else 5.0)
        speculative = speculative if speculative is not None else 2 * plain
        return (speculative if k else plain) + draft + verify

    def best_k(self, rows: float, ks: list[int]) -> int | None:
        """argmax over ks of E(k) / T(k) with `rows` sequences in each pass; None before the
        profiles are known."""
        if not self.ready:
            return None
        return max(ks, key=lambda k: self.keep.expected_tokens(k) / self.round_ms(k, rows))

    def describe(self, ks: list[int], rows: float) -> dict:
        table = {f"k={k}": round(self.keep.expected_tokens(k) / self.round_ms(k, rows) * rows * 1000, 1)
                 for k in ks} if self.ready else {}
        return {"profiles": {pool: vars(p) for pool, p in self.profiles.items()},
                "coordination_ms": {"with_drafts": self.coordination[True].value,
                                    "without": self.coordination[False].value},
                "predicted_tokens_per_s": table}
