"""Choosing k (and overlap) by measured throughput, per load level, so that speculation never
costs throughput: the router tries the candidates and keeps what its rounds actually yield,
where a cost model would have to predict contention it cannot see (a verify of k + 1
positions costs nearly k + 1 steps on this compute-bound CPU, about one on a memory-bound GPU).

Terms:
- arm: what an adaptive round runs: k drafts (0: the target alone) and, when overlap is
  "auto", whether it drafts the next window during verification (router/lookahead.py).
  The k of the arms form a ladder, 0 1 2 4 6 8 12 16 ... within [min_k, max_k] plus the
  configured k: steps large enough for neighbours to differ by more than the noise.
- load level: the router's sequences in flight when a round starts, bucketed: 1 | 2 | 3-5 |
  6-11 | 12-23 | 24+. Each level is about twice the one before, with a power of two in its
  middle, so that 8 closed-loop clients, which drop to 7 in flight between requests, stay
  in one level; the router stays at its level while the load is within a slack of it.
- goodput of an arm at a level: E(k) tokens a round (router/goodput.py: measured keep
  chances, far less noisy than a window's own token count) times the rounds per ms of its
  rounds' wall time (a ratio of sums), times the mean sequences in flight: the tokens per
  second the router emits across its sequences. A request's first round (its prefill), a
  round cut short by the request's end, and a round whose load lies outside the level are
  left out: they say nothing about the arm at this load. Every such round of the router
  (fixed-k requests too) fills the level's table of measured tokens per second by arm.
- window: adaptive rounds of one arm over at least one second (the machine's speed wanders
  over seconds; a fraction of a second measures that, not the arm) and at least 8 measured
  rounds of every sequence in flight, or 32 over three seconds where most rounds wait on
  prefills (so that a poor challenger is not run for long); after the first two rounds of
  every sequence under the arm (they share batches and queues with the arm before).

Per level, a climb over the arms (a hill climb, chosen over a bandit because neighbouring
k differ smoothly and it needs no prior over all arms: a trial costs windows of a neighbour,
which is close to the best when the best is near). The incumbent runs a window, then a
challenger (a neighbour on the ladder, or the other overlap), then the incumbent again: the
challenger's windows are compared with the incumbent's on both sides of them, which cancels
a steady drift of the machine's speed. The comparison's error comes from the spread of the
incumbent's own successive windows (or from its rounds, if larger); while the difference is
within two errors, another pair of windows is run, up to four. Then:
- worse by more than the margin (4 %): rejected, and so is everything beyond it;
- within the margin, or not clear after four pairs: a tie. A tie with the target alone (k =
  0, a challenger in every climb) goes to it, and so does a tie with a smaller k whose
  deficit, if any, is surely under the margin: as fast with fewer drafts is less draft-pool
  work and no bet on acceptance, and speculation must beat the target alone, not just tie
  it. Other ties are not taken (no flapping between arms within noise of each other); where
  the challenger measured at least as fast, the arm beyond it is tried too (a slope too
  gentle to see in one step);
- better by more than the margin and clear, over two pairs at least: taken; the climb goes
  on in that direction.
When no challenger is left the level is settled: the incumbent runs, checked against its own
round time and E(k) at settling; a change of more than a quarter (acceptance or contention
moved) starts a climb again, and so does a recheck every 8, 16, then 32 windows (doubling
while rechecks keep the incumbent). A level met for the first time starts a step down the
ladder from the nearest known level's choice if its load is heavier (up if lighter), or
from the prior (the predicted cost model, router/goodput.py) if none is known; a level met
again starts from its own choice, and a recheck it was in when its load went elsewhere is
dropped (windows seconds apart would be compared).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from router.goodput import CostModel, Ema, KeepChances

LEVEL_EDGES = (1, 2, 3, 6, 12, 24)     # a level holds rounded loads in [edge_i, edge_i+1)
_LADDER = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32)
MARGIN = 0.04
_Z = 2.0                                # and by two standard errors
_ALONE = -2                             # the direction of the target-alone check: no loss blocks it
_MOST_PAIRS = 4                         # challenger windows a duel may take to be clear
_PRIOR_WINDOW_NOISE = 0.05              # sd of the log ratio of two windows of one arm, until measured
_NOISE_WEIGHT = 0.2
_MIN_WINDOW_ROUNDS = 32
_WINDOW_ROUNDS_PER_SEQUENCE = 8         # a window spans at least 8 rounds of every sequence
_SETTLE_ROUNDS_PER_SEQUENCE = 2         # rounds of every sequence after a switch that are not measured
_MIN_WINDOW_S = 1.0                     # the machine's speed wanders over seconds: average over one
_MAX_WINDOW_S = 3.0                     # where most rounds wait on prefills, a window ends by time
_PAUSE_S = 2.0                          # a gap this long between rounds ends the windows being compared
_DRIFT = 0.25
_FIRST_RECHECK, _LAST_RECHECK = 8, 32   # windows between rechecks of a settled level
_TABLE_DECAY = 1 / 512                  # per measured round: the table shows about the last 500


@dataclass(frozen=True, order=True)
class Arm:
    k: int
    overlap: bool = False

    @property
    def name(self) -> str:
        return f"k={self.k}" + (" overlap" if self.overlap else "")


def level_of(load: float) -> int:
    n = max(round(load), 1)
    return max(i for i, edge in enumerate(LEVEL_EDGES) if n >= edge)


def within_level(level: int, in_flight: int) -> bool:
    """Whether `in_flight` lies in the level or within its slack, an eighth of its lower edge
    (at least 1) on either side: a closed loop of 8 clients, 7 in flight between requests,
    or of 2 clients, 1 in flight, stays where it is."""
    low = LEVEL_EDGES[level]
    high = LEVEL_EDGES[level + 1] - 1 if level + 1 < len(LEVEL_EDGES) else math.inf
    slack = max(1, low // 8)
    return low - slack <= in_flight <= high + slack


def level_name(level: int) -> str:
    low = LEVEL_EDGES[level]
    if level + 1 == len(LEVEL_EDGES):
        return f"{low}+"
    high = LEVEL_EDGES[level + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


@dataclass
class Measure:
    """Sums over rounds: tokens, wall ms, sequences in flight x ms, and ms squared (the mean
    round time's standard error)."""
    tokens: float = 0.0
    ms: float = 0.0
    load_ms: float = 0.0
    rounds: float = 0.0
    ms_sq: float = 0.0

    def add(self, tokens: int, ms: float, in_flight: int) -> None:
        self.tokens += tokens
        self.ms += ms
        self.load_ms += in_flight * ms
        self.rounds += 1
        self.ms_sq += ms * ms

    def scale(self, factor: float) -> None:
        for name, value in vars(self).items():
            setattr(self, name, value * factor)

    def __add__(self, other: "Measure") -> "Measure":
        return Measure(**{name: value + getattr(other, name) for name, value in vars(self).items()})

    def tokens_per_s(self) -> float:
        """Tokens per second across the router's sequences: tokens per ms of a sequence's
        rounds times the sequences in flight."""
        return self.tokens / self.ms * (self.load_ms / self.ms) * 1000 if self.ms > 0 else 0.0

    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def goodput(self, expected_tokens: float) -> float:
        """Tokens per second across the router's sequences with E(k) tokens a round: the
        decision's measure (router/goodput.py says why E(k) and not the window's own count)."""
        return expected_tokens * self.rounds / self.ms * (self.load_ms / self.ms) * 1000 if self.ms > 0 else 0.0

    def relative_error_sq(self) -> float:
        """Var / mean^2 of the mean round time, rounds taken as independent."""
        if self.rounds < 2 or self.ms <= 0:
            return math.inf
        variance = max(self.ms_sq - self.ms * self.ms / self.rounds, 0.0) / (self.rounds - 1)
        return variance / self.rounds / (self.ms / self.rounds) ** 2


@dataclass
class _Duel:
    challenger: Arm
    direction: int                       # +1 / -1 along the ladder, 0 the other overlap, _ALONE k = 0
    plan: list[str] = field(default_factory=lambda: ["challenger", "incumbent"])   # windows to run
    windows: list[Measure] = field(default_factory=list)                          # the challenger's


class LevelClimb:
    """The choice at one load level: which arm adaptive rounds use, learned by a climb."""

    def __init__(self, arms: list[Arm], start: Arm, keep: KeepChances):
        self.keep = keep                       # E(k) and its error, router/goodput.py
        self.arms = arms                       # the ladder (and its overlap twins), in order
        self.incumbent = start
        self.table: dict[Arm, Measure] = {}    # recent throughput of every arm measured here
        self.rounds = 0                        # measured adaptive rounds at this level
        self.settled_after: int | None = None  # rounds the first climb took
        self.climbs = self.changes = 0
        self._queue: list[tuple[Arm, int]] = []   # challengers still to try, with their direction
        self._tried: set[Arm] = set()
        self._duel: _Duel | None = None
        self._incumbent_windows: list[Measure] = []   # the incumbent's last windows, oldest first
        self._fresh = False                    # the last window was the incumbent's
        self._window = Measure()
        self._window_started = self._last_round_at = 0.0
        self._skip = 0
        self._window_noise = Ema(weight=_NOISE_WEIGHT)   # (log ratio of successive incumbent windows)^2
        self._reference: tuple[float, float] | None = None   # ms a round, E(k) at settling
        self._recheck_in = self._recheck_period = _FIRST_RECHECK
        self.duels: list[dict] = []            # the last few duels' verdicts, for describe
        # The target alone against the incumbent when last measured: far behind, it is not
        # tried again until the level's round time or acceptance moves.
        self._alone_ratio = 1.0
        self.windows: list[dict] = []
        self._start_climb()

    @property
    def running(self) -> Arm:
        duel = self._duel
        return duel.challenger if duel is not None and duel.plan[0] == "challenger" else self.incumbent

    @property
    def settled(self) -> bool:
        return not self._queue and self._duel is None

    def record(self, arm: Arm, tokens: int, ms: float, in_flight: int) -> None:
        """Any measured round at this level, fixed-k ones too: the table."""
        for measure in self.table.values():
            measure.scale(1 - _TABLE_DECAY)
        self.table.setdefault(arm, Measure()).add(tokens, ms, in_flight)

    def observe(self, arm: Arm, tokens: int, ms: float, in_flight: int, now: float) -> None:
        """A measured adaptive round that ran `arm` here and ended at `now` (seconds)."""
        self.rounds += 1
        if now - self._last_round_at > _PAUSE_S:
            self._paused()
        self._last_round_at = now
        if arm != self.running:
            return                           # it started before the last switch
        if self._skip > 0:
            self._skip -= 1
            return
        if not self._window.rounds:
            self._window_started = now
        self._window.add(tokens, ms, in_flight)
        enough = max(_MIN_WINDOW_ROUNDS, _WINDOW_ROUNDS_PER_SEQUENCE * in_flight)
        span = now - self._window_started
        if span >= _MIN_WINDOW_S and (self._window.rounds >= enough or
                                      (span >= _MAX_WINDOW_S and self._window.rounds >= _MIN_WINDOW_ROUNDS)):
            before, window, self._window = self.running, self._window, Measure()
            self.windows = (self.windows + [{"arm": before.name, "rounds": int(window.rounds),
                                             "round_ms": round(window.ms / window.rounds, 1),
                                             "load": round(window.load_ms / window.ms, 1),
                                             "span_s": round(now - self._window_started, 2),
                                             "rounds_per_s": round(window.goodput(1.0), 1)}])[-12:]
            self._finished(window)
            if self.running != before:
                # their next rounds share batches with the old arm's, its pools' queues
                self._skip = _SETTLE_ROUNDS_PER_SEQUENCE * in_flight

    def _paused(self) -> None:
        """The level saw no rounds for a while (its load went elsewhere): windows from before
        are not compared with windows after. A first climb goes on where it was, its duel
        under way from the start; a settled level's recheck is dropped, so that coming back
        to the level runs its choice, and the next recheck comes at its usual time."""
        self._window, self._skip = Measure(), 0
        self._incumbent_windows, self._fresh = [], False
        if self.settled_after is not None:
            self._queue, self._duel, self._reference = [], None, None
            self._recheck_in = self._recheck_period
        elif self._duel is not None:
            self._queue.insert(0, (self._duel.challenger, self._duel.direction))
            self._duel = None

    def _finished(self, window: Measure) -> None:
        duel = self._duel
        role = duel.plan.pop(0) if duel is not None else "incumbent"
        if role == "challenger":
            duel.windows.append(window)
            self._fresh = False
            return
        if self._incumbent_windows:
            self._window_noise.add(math.log(window.goodput(1.0) / self._incumbent_windows[-1].goodput(1.0)) ** 2)
        self._incumbent_windows = (self._incumbent_windows + [window])[-(_MOST_PAIRS + 1):]
        self._fresh = True
        if duel is not None and not duel.plan:
            self._judge(duel)
        elif duel is None and not self._queue:
            self._check_settled(window)
        if self._duel is None and self._queue and self._fresh:
            arm, direction = self._queue.pop(0)
            self._tried.add(arm)
            self._duel = _Duel(arm, direction)
        if self.settled and self.settled_after is None:
            self.settled_after = self.rounds

    def _judge(self, duel: _Duel) -> None:
        """The challenger's windows against the incumbent's on both sides of them: another
        pair of windows while the difference is within two standard errors, up to
        _MOST_PAIRS; then a win, a loss or a tie."""
        pairs = len(duel.windows)
        challenger, incumbent = _pooled(duel.windows), _pooled(self._incumbent_windows[-(pairs + 1):])
        ratio = (challenger.goodput(self.keep.expected_tokens(duel.challenger.k))
                 / max(incumbent.goodput(self.keep.expected_tokens(self.incumbent.k)), 1e-9))
        # The error of the log ratio: from the spread of the incumbent's own windows (the
        # machine's wandering speed), or from the rounds within them if that is larger.
        per_window = self._window_noise.get(_PRIOR_WINDOW_NOISE ** 2) / 2
        spread = per_window / pairs + per_window / (pairs + 1)
        error = math.sqrt(max(spread, challenger.relative_error_sq() + incumbent.relative_error_sq())
                          + self.keep.relative_variance(duel.challenger.k)
                          + self.keep.relative_variance(self.incumbent.k))
        clear = abs(math.log(ratio)) > _Z * error
        # A win takes two pairs at least: one pair that looks better by chance is confirmed
        # or undone by the next (the cost of a false switch is a climb away from the best).
        looks_better = ratio > 1 + MARGIN and (clear or pairs < _MOST_PAIRS)
        if pairs < _MOST_PAIRS and ((not clear and abs(ratio - 1) > MARGIN) or (looks_better and pairs < 2)):
            duel.plan = ["challenger", "incumbent"]
            return
        self._duel = None
        outcome = "win" if ratio > 1 + MARGIN and clear else "tie" if ratio >= 1 - MARGIN else "loss"
        if duel.challenger.k == 0:
            self._alone_ratio = ratio
        if outcome == "tie" and duel.challenger.k < self.incumbent.k and (
                duel.challenger.k == 0 or math.log(ratio) - _Z * error >= math.log(1 - MARGIN)):
            outcome = "win"      # as fast with fewer drafts: less draft-pool work, no bet on acceptance
        self.duels = (self.duels + [{"challenger": duel.challenger.name, "incumbent": self.incumbent.name,
                                     "ratio": round(ratio, 3), "pairs": pairs, "outcome": outcome}])[-8:]
        if outcome == "win":
            self.incumbent = duel.challenger
            self.changes += 1
            # its last window is the one before its first duel as incumbent
            self._incumbent_windows, self._fresh = duel.windows[-1:], True
            # on in the same direction; after a change of overlap, both ways along the ladder
            self._queue = self._neighbours(duel.challenger, only=duel.direction if duel.direction in (-1, 1) else None)
        elif outcome == "tie" and duel.direction in (-1, 1) and ratio >= 1:   # a gentle rise: look further
            beyond = self._step(duel.challenger, duel.direction)
            if beyond is not None and beyond not in self._tried:
                self._queue.insert(0, (beyond, duel.direction))
        elif duel.direction in (-1, 1):                 # a loss: nothing further that way
            self._queue = [(arm, d) for arm, d in self._queue if d != duel.direction]
        if not self._queue:
            self._reference = None

    def _check_settled(self, window: Measure) -> None:
        """The incumbent of a settled level against itself at settling; a recheck now and then."""
        now = (window.ms / window.rounds, self.keep.expected_tokens(self.incumbent.k))
        if self._reference is None:
            self._reference = now
            return
        self._recheck_in -= 1
        drifted = any(abs(a / b - 1) > _DRIFT for a, b in zip(now, self._reference))
        if drifted:
            self._recheck_period = _FIRST_RECHECK
            self._alone_ratio = 1.0
            self._start_climb()
        elif self._recheck_in <= 0:
            self._recheck_period = min(2 * self._recheck_period, _LAST_RECHECK)
            self._start_climb()

    def _start_climb(self) -> None:
        self.climbs += 1
        self._tried = {self.incumbent}
        self._queue = self._neighbours(self.incumbent)
        self._reference = None
        self._recheck_in = self._recheck_period

    def _neighbours(self, arm: Arm, only: int | None = None) -> list[tuple[Arm, int]]:
        """Challengers of arm: one step down and one up the ladder, the other overlap, and
        the target alone (speculation must beat it, not only its neighbours); `only` keeps
        one direction (a climb does not go back the way it came)."""
        out = [(self._step(arm, d), d) for d in (-1, 1) if only in (None, d)]
        twin = Arm(arm.k, not arm.overlap)
        if twin in self.arms and only in (None, 0):
            out.append((twin, 0))
        if Arm(0) in self.arms and only in (None, -1) and self._alone_ratio >= 1 - 3 * MARGIN:
            out.append((Arm(0), _ALONE))
        seen, unique = set(self._tried), []
        for a, d in out:
            if a is not None and a not in seen:
                seen.add(a)
                unique.append((a, d))
        return unique

    def _step(self, arm: Arm, direction: int) -> Arm | None:
        ks = sorted({a.k for a in self.arms})
        i = ks.index(arm.k) + direction
        if not 0 <= i < len(ks):
            return None
        same = Arm(ks[i], arm.overlap)
        return same if same in self.arms else Arm(ks[i], False)

    def describe(self) -> dict:
        return {"choice": self.incumbent.name, "k": self.incumbent.k, "overlap": self.incumbent.overlap,
                "running": self.running.name, "settled": self.settled, "settled_after_rounds": self.settled_after,
                "rounds": self.rounds, "climbs": self.climbs, "changes": self.changes,
                "window_noise": round(math.sqrt(self._window_noise.get(_PRIOR_WINDOW_NOISE ** 2) / 2), 4),
                "last_duels": self.duels, "last_windows": self.windows,
                "tokens_per_s": {arm.name: round(m.tokens_per_s(), 1) for arm, m in sorted(self.table.items())}}


def _pooled(windows: list[Measure]) -> Measure:
    total = Measure()
    for window in windows:
        total = total + window
    return total


def ladder(min_k: int, max_k: int, k: int, overlap_auto: bool) -> list[Arm]:
    ks = sorted({v for v in _LADDER if min_k <= v <= max_k} | {min_k, max_k, k})
    return [Arm(v, o) for v in ks for o in ((False, True) if overlap_auto and v else (False,))]


class KController:
    """A router's adaptive choice: a LevelClimb per load level, the level from the smoothed
    load. Every measured round of the router (fixed k ones too) fills its level's table and
    the keep chances; only adaptive rounds that ran the level's current arm move a climb."""

    def __init__(self, min_k: int, max_k: int, start_k: int, overlap: bool | str = False):
        self.min_k, self.max_k = min_k, max_k
        self.overlap_auto = overlap == "auto"
        self.default_overlap = overlap is True
        self.arms = ladder(min_k, max_k, start_k, self.overlap_auto)
        self.start = Arm(start_k)
        self.keep = KeepChances(max_k)
        self.prior = CostModel(self.keep)     # its profiles come from the pools (router/speculation.py)
        self.levels: dict[int, LevelClimb] = {}
        self.load: int | None = None           # sequences in flight at the last round's start
        self._level: int | None = None

    def note_load(self, in_flight: int) -> int:
        """A round starts with `in_flight` sequences at the router: the level it runs at, the
        level before while the load stays within its slack."""
        self.load = in_flight
        if self._level is None or not within_level(self._level, in_flight):
            self._level = level_of(in_flight)
        return self._level

    @property
    def level(self) -> int:
        return self._level or 0

    @property
    def current(self) -> Arm:
        return self.choose(self.level, self.max_k)

    def climb(self, level: int) -> LevelClimb:
        if level not in self.levels:
            self.levels[level] = LevelClimb(self.arms, self._start_for(level), self.keep)
        return self.levels[level]

    def choose(self, level: int, cap: int) -> Arm:
        """The arm an adaptive round at `level` runs: its k within [min_k, max_k] and the
        request's cap, and overlap only where it is auto, whatever the climb's state says."""
        arm = self.climb(level).running
        k = min(max(arm.k, self.min_k), self.max_k, max(cap, 0))
        return Arm(k, arm.overlap and self.overlap_auto and k > 0)

    def overlap_for(self, arm: Arm) -> bool:
        return arm.overlap if self.overlap_auto else self.default_overlap

    def observe(self, level: int, arm: Arm, drafted: int, accepted: int, round_ms: float, model_ms: float,
                in_flight: int, adaptive: bool, measured: bool, now: float | None = None) -> None:
        """A finished round that asked for `arm` and verified `drafted` drafts; `measured` is
        false for a request's first round and for one its end cut short. A round whose load
        lies outside its level measures nothing either (the load rose or fell past it)."""
        if drafted:
            self.keep.observe(drafted, accepted)
        self.prior.observe(bool(drafted), round_ms, model_ms)
        if not measured or not within_level(level, in_flight) or not math.isfinite(round_ms) or round_ms <= 0:
            return
        arm = Arm(arm.k, arm.overlap and arm.k > 0 and self.overlap_auto)
        climb = self.climb(level)
        climb.record(arm, accepted + 1, round_ms, in_flight)
        if adaptive:
            climb.observe(arm, accepted + 1, round_ms, in_flight, time.monotonic() if now is None else now)

    def _start_for(self, level: int) -> Arm:
        """A level's first arm: the choice of the nearest level known, one step down the
        ladder for a heavier load and up for a lighter one (the best k does not grow with
        load: each extra position of a verify costs more in a fuller batch); else the prior's."""
        measured = [other for other, climb in self.levels.items() if climb.rounds]
        if measured:
            nearest = min(measured, key=lambda other: (abs(other - level), other))
            known = self.levels[nearest]
            return known._step(known.incumbent, -1 if level > nearest else 1) or known.incumbent
        guess = self.prior.best_k(LEVEL_EDGES[level], sorted({arm.k for arm in self.arms}))
        if guess is not None:
            return Arm(guess)
        return self.start

    def describe(self) -> dict:
        ks = sorted({arm.k for arm in self.arms})
        return {"level": level_name(self.level), "k": self.current.k, "overlap": self.current.overlap,
                "load": self.load,
                "keep_chances": [round(h, 3) for h in self.keep.chances()],
                "levels": {level_name(level): climb.describe() for level, climb in sorted(self.levels.items())},
                "prior": self.prior.describe(ks, LEVEL_EDGES[self.level])}
