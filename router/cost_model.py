"""What a round costs, learned online from every call the pools answer.

Terms:
- pass: one batched forward pass of a pool's engine (with, for the target, the acceptance
  rule over its rows). Its shape: rows (sequences in it), positions (new positions over all
  rows) and attention (sum over rows of new positions x the row's context length, in
  thousands). Engines report each pass's shape and time (replicas/protocol.py, `passes`).
- pass time model: ms = theta . (1, rows, positions, attention): a fixed cost, a cost per
  row (logits, sampling, the rule: Python and small kernels), per position (the weights'
  arithmetic: on a CPU each position costs nearly a step; on a GPU far less until the
  arithmetic outweighs the weight reads) and per attended position.
- coordination: a round's wall time at the router beyond its calls' engine time: handle
  hops, serialization, batch windows, queueing. Measured per round kind (with a draft call
  or without), as an average with forgetting, less c_draft D (below): C(d), a round's
  coordination with no drafts in flight.
- drafts in flight D: the drafts of every sequence's latest round at this router. A round
  waits for the batches of its neighbours' rounds, so their drafts are part of its time.
- c_draft: what one more draft in flight adds to a round's coordination (DraftsInFlightCost):
  the drafts ride the handle calls (a pool's with their probabilities), and the router
  drafts, tracks and prices each one. No pass shows that cost, and measured as a constant per kind of round it
  would be priced as fixed: it would lower the batch's rate and so make each draft look
  cheaper the more is drafted. On the default cluster the hop grew by 0.1-0.4 ms per
  drafted position at 8-32 clients (2026-12-06, docs/BENCHMARKS.md), where the passes price
  a drafted position at about 0.2 ms.

The target's model has no per-row term: a row costs through its positions. Most of the
target's passes are single-token steps, where rows and positions are the same number, so
the passes cannot tell a per-row cost from a per-position one, and a fit free to choose
put the step's cost on rows (measured 2026-12-05 at 32 clients: per row 0.38 ms, per
position 0.05 ms) and so priced a draft's position at a fifth of what the batch then paid
for it (0.85 ms a position in the window pass; docs/BENCHMARKS.md). On a CPU a position is
the cost, as the engine bench shows (8 rows x 5 positions cost 3.8x 8 x 1); on a GPU both
are small beside the fixed cost. The draft pool's passes keep the per-row term (a draft
adds a row to each of its passes).

Why least squares on few terms rather than a table over shape buckets: the choice of k
must price shapes it is not running now (at k = 0 every verify has one position per row,
yet the controller must know what k = 2 would cost), so the model has to extrapolate, and
a linear model in these terms extrapolates the way the hardware does.

Two fits, on two time scales: a slow one (the last several hundred passes) that has seen the
shapes vary (loads come and go, k changes, the controller explores now and then), pulled
towards the replica's first passes at start (replicas/engines/huggingface/engine.py,
`startup_passes`); and the one the controller uses, on the last few dozen passes (contention
changes over seconds), pulled towards the slow fit. So a direction the recent passes do not
vary along (positions, while every row has one) keeps what the longer past measured instead
of wandering, and the level follows the machine. Coefficients are kept at or above zero: a
fit that says more positions cost less time would make the controller draft without bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_TERMS = ("fixed", "per_row", "per_position", "per_kilo_attention")
ROW_FREE = (0, 2, 3)      # the target's terms: no per-row cost
_FORGET = 0.98            # weight of the past, per pass observed: about the last 50 passes count
_FORGET_SLOW = 0.998      # the slow fit's: about the last 500
# Ridge pull towards the anchor, in passes' worth of evidence per term. Anchoring a
# coefficient is what makes extrapolation safe; the data still dominates within a few dozen
# passes where it varies.
_ANCHOR_STRENGTH = 2.0
# Before a replica's start-up passes are known: about one of the bundled target's steps on
# this CPU. Only the first round or two of a fresh router run on it.
_GENERIC_ANCHOR = (1.0, 0.1, 0.2, 0.0)
_VARIANCE_FLOOR = 0.05 ** 2
_COORDINATION_EMA = 0.1
_DEFAULT_COORDINATION_MS = 5.0
# c_draft: the means it is measured around follow the last 50 rounds or so (the level moves
# with the load); the slope is read from the last 2000 (seconds at any load: the drafts in
# flight move little from one round to the next).
_IN_FLIGHT_MEANS = 0.02
_IN_FLIGHT_FORGET = 0.9995
_EFFECTIVE = 2.0         # a decayed count's effective sample size, per unit of its sum
_IN_FLIGHT_Z = 2.0       # c_draft is its slope less this many standard errors


@dataclass(frozen=True)
class PassShape:
    rows: int
    positions: int
    attention: float        # sum over rows of new positions x context length, in thousands

    def terms(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.rows), float(self.positions), self.attention)


def attention_work(new_and_context: list[tuple[int, int]]) -> float:
    """The attention term of a pass whose rows compute `new` positions over `context` ones."""
    return sum(new * context for new, context in new_and_context) / 1000


class PassCost:
    """ms of one pass of a pool's engine as a function of its shape, fitted online."""

    def __init__(self, anchor: tuple[float, ...] = _GENERIC_ANCHOR, terms: tuple[int, ...] = (0, 1, 2, 3)):
        self._terms = terms       # which of _TERMS the fit uses; the rest stay at zero
        self._fast = _Sums(_FORGET, terms)
        self._slow = _Sums(_FORGET_SLOW, terms)
        self._anchor = [anchor[i] for i in terms]
        self._theta: list[float] | None = None
        self.passes = 0
        self.error = _Average(_COORDINATION_EMA)     # |log(measured / predicted)| before each pass is added

    def anchor_on(self, shapes: list[tuple[PassShape, float]]) -> None:
        """The replica's start-up passes: a fit of them becomes the slow fit's anchor, and
        they count as passes too."""
        start = _Sums(1.0, self._terms)
        start.add(shapes)
        self._anchor = start.solve(self._anchor, 1e-3)
        self.observe_all(shapes)

    def observe(self, shape: PassShape, ms: float) -> None:
        self.observe_all([(shape, ms)])

    def observe_all(self, passes: list[tuple[PassShape, float]]) -> None:
        """A batched call's passes: each one's error against the model before any of them,
        then all added (the model is solved again once, when next asked)."""
        if self.passes:
            for shape, ms in passes:
                predicted = self.predict(shape)
                if predicted > 0 and ms > 0:
                    self.error.add(abs(_log(ms / predicted)))
        self._fast.add(passes)
        self._slow.add(passes)
        self.passes += len(passes)
        self._theta = None

    @property
    def theta(self) -> list[float]:
        """The coefficients of all four of _TERMS (zero where the model does not use a term)."""
        if self._theta is None:
            slow = self._slow.solve(self._anchor, _ANCHOR_STRENGTH)
            theta = [0.0] * len(_TERMS)
            for i, c in zip(self._terms, self._fast.solve(slow, _ANCHOR_STRENGTH)):
                theta[i] = c
            self._theta = theta
        return self._theta

    def predict(self, shape: PassShape) -> float:
        return max(sum(c * x for c, x in zip(self.theta, shape.terms())), 0.0)

    def describe(self) -> dict:
        return {"ms": {term: round(c, 4) for term, c in zip(_TERMS, self.theta)}, "passes": self.passes,
                "mean_abs_log_error": round(self.error.get(0.0), 4)}


class _Sums:
    """The normal equations of a least-squares fit with forgetting: sum w x x^T and sum w x y."""

    def __init__(self, forget: float, terms: tuple[int, ...]):
        self.forget, self.terms = forget, terms
        n = len(terms)
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n

    def add(self, passes: list[tuple[PassShape, float]]) -> None:
        xx, xy, forget = self.xx, self.xy, self.forget
        n = len(self.terms)
        for shape, ms in passes:
            every = shape.terms()
            x = [every[i] for i in self.terms]
            for i in range(n):
                xy[i] = forget * xy[i] + x[i] * ms
                row = xx[i]
                for j in range(n):
                    row[j] = forget * row[j] + x[i] * x[j]

    def solve(self, anchor: list[float], strength: float) -> list[float]:
        return _solve(self.xx, self.xy, anchor, strength)


class _Average:
    """An average with forgetting (exponential weights)."""

    def __init__(self, weight: float):
        self.weight, self.value = weight, None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class DraftsInFlightCost:
    """c_draft: the slope of a round's coordination against the drafts in flight.

    Each round's coordination and drafts in flight are taken as deviations from their recent
    means over the rounds of its kind (with a draft call or without: a draft call comes with
    drafts, and its hop must not pass for theirs), so that a level that drifts with the load
    does not pass for a slope either. The slope b = sum w dD dC / sum w dD^2 is lowered by
    two standard errors: where the drafts in flight hardly varied (the controller held k, or
    few rounds were seen) a slope of the noise's making would price every draft higher and
    stop drafting that pays, so c_draft = max(b - 2 se(b), 0). The weights' effective sample
    size is twice their sum (as in router/goodput.py), so se(b)^2 = residual variance /
    (2 sum w dD^2).

    Why coordination and not the whole round beyond the pass models' prediction: regressed
    on the drafts in flight, that residual gave 2-4 ms a draft at 8-32 clients on the default
    cluster (2026-12-06), which would have made greedy drafting at 16 clients cost three
    times the round it was measured to speed up by 4 %: a round's engine time beyond the
    prediction moves with where the sequences are in their requests, not only with their
    drafts."""

    def __init__(self):
        self._means: dict[bool, list[float]] = {}    # per kind of round: [mean D, mean C, rounds]
        self._cross = 0.0      # sum w (D - mean D)(C - mean C)
        self._spread = 0.0     # sum w (D - mean D)^2
        self._square = 0.0     # sum w (C - mean C)^2
        self._weight = 0.0
        self.rounds = 0

    def observe(self, draft_call: bool, drafts_in_flight: float, coordination_ms: float) -> None:
        means = self._means.setdefault(draft_call, [drafts_in_flight, coordination_ms, 0])
        d, c = drafts_in_flight - means[0], coordination_ms - means[1]
        self._cross = _IN_FLIGHT_FORGET * self._cross + d * c
        self._spread = _IN_FLIGHT_FORGET * self._spread + d * d
        self._square = _IN_FLIGHT_FORGET * self._square + c * c
        self._weight = _IN_FLIGHT_FORGET * self._weight + 1.0
        # plain means over a kind's first rounds, then forgetting: a mean that started at the
        # first round and moved from it slowly would make every later round deviate alike
        means[2] += 1
        step = max(1 / means[2], _IN_FLIGHT_MEANS)
        means[0] += step * d
        means[1] += step * c
        self.rounds += 1

    def slope(self) -> tuple[float, float]:
        """b and se(b) (0 and infinity before the drafts in flight varied)."""
        if self._spread <= 0 or self._weight <= 2:
            return 0.0, math.inf
        slope = self._cross / self._spread
        residual = max(self._square - slope * self._cross, 0.0) / self._weight
        return slope, math.sqrt(residual / (_EFFECTIVE * self._spread))

    @property
    def ms(self) -> float:
        slope, error = self.slope()
        return max(slope - _IN_FLIGHT_Z * error, 0.0)

    def describe(self) -> dict:
        slope, error = self.slope()
        return {"ms": round(self.ms, 4), "slope_ms": round(slope, 4),
                "standard_error_ms": round(error, 4) if math.isfinite(error) else None, "rounds": self.rounds}


@dataclass
class RoundCosts:
    """Everything a round's time is made of: the target's and the draft pool's passes, and
    the coordination of a round with a draft call and without."""
    target: PassCost = field(default_factory=lambda: PassCost(terms=ROW_FREE))
    draft: PassCost = field(default_factory=PassCost)
    coordination: dict[bool, _Average] = field(default_factory=lambda: {True: _Average(_COORDINATION_EMA),
                                                                         False: _Average(_COORDINATION_EMA)})
    in_flight: DraftsInFlightCost = field(default_factory=DraftsInFlightCost)
    drafts_in_flight: dict[bool, _Average] = field(default_factory=lambda: {True: _Average(_COORDINATION_EMA),
                                                                             False: _Average(_COORDINATION_EMA)})
    round_error: _Average = field(default_factory=lambda: _Average(_COORDINATION_EMA))
    measured_round: _Average = field(default_factory=lambda: _Average(_COORDINATION_EMA))
    predicted_round: _Average = field(default_factory=lambda: _Average(_COORDINATION_EMA))

    def observe_round(self, draft_call: bool, wall_ms: float, engine_ms: float,
                      predicted_ms: float | None = None, drafts_in_flight: float = 0.0) -> None:
        """engine_ms: the round's calls' engine time, with their queueing behind other batches
        (those batches' engine time)."""
        coordination = max(wall_ms - engine_ms, 0.0)
        self.coordination[draft_call].add(coordination)
        self.drafts_in_flight[draft_call].add(drafts_in_flight)
        self.in_flight.observe(draft_call, drafts_in_flight, coordination)
        if predicted_ms and wall_ms > 0:
            self.round_error.add(abs(_log(wall_ms / predicted_ms)))
            self.measured_round.add(wall_ms)
            self.predicted_round.add(predicted_ms)

    def coordination_ms(self, draft_call: bool) -> float:
        """C(d): a round's coordination with no drafts in flight. Until both kinds of round
        were seen, one stands in for the other (a draft hop about doubles a round's hops).
        A round with a draft call makes the same target call and one hop more, so it is never
        priced below one without: measured lower, it is the mix of rounds that drafted, not
        the draft call (at 8 greedy clients with draft_model, 2026-12-07: 30.9 ms with, 41.7
        without, and the controller drafted at k 1.6 for 0.65x the target alone)."""
        seen = self._without_drafts(draft_call)
        other = self._without_drafts(not draft_call)
        if seen is None:
            if other is None:
                return _DEFAULT_COORDINATION_MS * (2 if draft_call else 1)
            return other * 2 if draft_call else other / 2
        if other is None:
            return seen
        return max(seen, other) if draft_call else seen

    def _without_drafts(self, draft_call: bool) -> float | None:
        seen = self.coordination[draft_call].value
        if seen is None:
            return None
        return max(seen - self.in_flight.ms * self.drafts_in_flight[draft_call].get(0.0), 0.0)

    def describe(self) -> dict:
        return {"target_pass": self.target.describe(), "draft_pass": self.draft.describe(),
                "coordination_ms": {"with_draft_call": _rounded(self.coordination[True].value),
                                    "without": _rounded(self.coordination[False].value)},
                "draft_in_flight": self.in_flight.describe(),
                "round_mean_abs_log_error": _rounded(self.round_error.value)}

    def round_ms(self) -> dict:
        """Averages of the rounds' predicted and measured time (rounds the controller chose)."""
        return {"predicted": _rounded(self.predicted_round.value), "measured": _rounded(self.measured_round.value)}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _log(x: float) -> float:
    return math.log(x)


def _solve(xx: list[list[float]], xy: list[float], anchor: list[float], strength: float) -> list[float]:
    """argmin over theta of sum w (y - theta.x)^2 + strength * scale_i (theta_i - anchor_i)^2,
    every coefficient at or above zero: one that comes out negative is held at zero and the
    rest fitted again. scale_i is the weighted variance of term i (floored at 5 % of its mean
    square), so the pull is `strength` passes' worth of the data's own spread: negligible
    along a term the passes vary in, decisive along one they do not. The fixed cost is not
    pulled: it takes whatever level the slopes leave."""
    free = list(range(len(xy)))
    while True:
        theta = _ridge(xx, xy, anchor, strength, free)
        negative = [i for i in free if theta[i] < 0]
        if not negative:
            return theta
        free = [i for i in free if i not in negative]


def _ridge(xx, xy, anchor, strength, free: list[int]) -> list[float]:
    theta = [0.0] * len(xy)
    if not free:
        return theta
    weight = xx[0][0]
    a = [[xx[i][j] for j in free] for i in free]
    b = [xy[i] for i in free]
    for row, i in enumerate(free):
        if weight <= 0:
            scale = 1.0
        elif i == 0:
            scale = 1e-9 * weight
        else:
            mean, square = xx[0][i] / weight, xx[i][i] / weight
            scale = max(square - mean * mean, _VARIANCE_FLOOR * square, 1e-9)
        a[row][row] += strength * scale
        b[row] += strength * scale * anchor[i]
    for row, value in zip(free, _gauss(a, b)):
        theta[row] = value
    return theta


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (small, symmetric positive definite) by elimination with pivoting."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(m[r][r]) < 1e-12:
            continue
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
