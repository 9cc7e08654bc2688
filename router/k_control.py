"""Choosing k (and overlap) by measured throughput, per load level, so that speculation never
costs throughput: the router tries the candidates and keeps what its rounds actually yield,
where a cost model would have to predict contention it cannot see (a verify of k + 1
positions costs nearly k + 1 steps on this compute-bound CPU, about one on a memory-bound GPU).

Terms:
- arm: what an adaptive round runs: k drafts (0: the target alone) and, when overlap is
  "auto", whether it drafts the next window during verification (router/lookahead.py); for
  hybrid requests, whether the draft pool takes part (lookup drafts where a match is long
  enough, the pool's elsewhere) or lookup drafts alone: at load, a verify batch waits for its
  slowest row, so a batch that mixes the two kinds runs at the pool's pace (docs/BENCHMARKS.md).
  The k of the arms form a ladder, 0 1 2 4 6 8 12 16 ... within [min_k, max_k] plus the
  configured k: steps large enough for neighbours to differ by more than the noise.
- load level: the router's sequences in flight when a round starts, bucketed: 1 | 2 | 3-5 |
  6-11 | 12-23 | 24+. Each level is about twice the one before, with a power of two in its
  middle, so that 8 closed-loop clients, which drop to 7 in flight between requests, stay
  in one level; the router stays at its level while the load is within a slack of it.
- goodput of an arm at a level: the tokens the router emits per second of wall time across
  all its sequences while the arm runs there, every round counted, prefills included (they
  are part of what a client waits for, and a larger k meets them more often per second). A
  round whose k was whole counts E(k) tokens (router/goodput.py: measured keep chances, far
  less noisy than a window's own token count, the same quantity); one the request's end cut
  short counts what it yielded. Summing each round's tokens over its own time and scaling
  by the load would leave out the time between a sequence's rounds and, where prefill
  rounds are left out, most of the slow ones: on this CPU at 16 and 32 clients that read
  up to twice the throughput the clients got, and differently for each arm.
- window: a stretch of wall time at one level while an arm runs, of at least one second
  (the machine's speed wanders over seconds; a fraction of a second measures that, not the
  arm) and at least 8 rounds of every sequence in flight, or 32 rounds over three seconds;
  begun after the first two rounds of every sequence under the arm (they share batches and
  queues with the arm before). It counts every round at the level, fixed-k requests' too
  (they share the machine), and is dropped where fewer than three quarters of its rounds
  were adaptive, where the load leaves the level, or where the level sees no round for two
  seconds (the time between would count without its tokens).

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
again starts from its own choice, and a climb or recheck it was in when its load went
elsewhere goes on where it was when the load comes back: its windows are compared across the
gap, and the spread of successive incumbent windows, across gaps too, is the comparison's
error (a closed-loop client that comes and goes, as the bench does, would otherwise never
finish a duel at high load, where each window takes seconds).
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
_TABLE_WEIGHT = 0.25                    # of an arm's newest window in the table: about its last four
_ADAPTIVE_SHARE = 0.75                  # a window of mostly fixed-k requests' rounds measures no arm


@dataclass(frozen=True, order=True)
class Arm:
    k: int
    overlap: bool = False
    lookup: bool = False       # a hybrid round's drafts by lookup alone, the draft pool left out

    @property
    def name(self) -> str:
        return f"k={self.k}" + (" overlap" if self.overlap else "") + (" lookup" if self.lookup else "")


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
    """Sums over a window's rounds: the whole ones by their drafts verified (each yields E(k)
    tokens, read from the keep chances when the window is, so that windows compared use the
    same E), the tokens of rounds cut short or without drafts, all rounds, the adaptive ones among them, their
    ms (the level's round time), and the window's wall seconds."""
    whole: dict[int, float] = field(default_factory=dict)
    counted_tokens: float = 0.0
    rounds: float = 0.0
    adaptive: float = 0.0
    ms: float = 0.0
    seconds: float = 0.0

    def add(self, drafted: int, whole: bool, tokens: int, ms: float, adaptive: bool) -> None:
        # A round without drafts yields what its single-token steps made (one, or up to
        # pools.target.decode_steps): no chance in it, so its own count, not E(0) = 1.
        if whole and drafted:
            self.whole[drafted] = self.whole.get(drafted, 0.0) + 1
        else:
            self.counted_tokens += tokens
        self.rounds += 1
        self.adaptive += adaptive
        self.ms += ms

    def scaled(self, factor: float) -> "Measure":
        return Measure({k: n * factor for k, n in self.whole.items()},
                       *(getattr(self, name) * factor for name in _SUMS))

    def __add__(self, other: "Measure") -> "Measure":
        whole = dict(self.whole)
        for k, n in other.whole.items():
            whole[k] = whole.get(k, 0.0) + n
        return Measure(whole, *(getattr(self, name) + getattr(other, name) for name in _SUMS))

    def tokens_per_s(self, keep: KeepChances) -> float:
        """Tokens per second of wall time across the router's sequences."""
        tokens = self.counted_tokens + sum(n * keep.expected_tokens(k) for k, n in self.whole.items())
        return tokens / self.seconds if self.seconds > 0 else 0.0

    def round_ms(self) -> float:
        return self.ms / self.rounds if self.rounds else 0.0


_SUMS = ("counted_tokens", "rounds", "adaptive", "ms", "seconds")   # Measure's fields after `whole`


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
        self.table: dict[Arm, Measure] = {}    # recent windows of every arm measured here
        self.rounds = 0                        # adaptive rounds at this level
        self.settled_after: int | None = None  # rounds the first climb took
        self.climbs = self.changes = 0
        self._queue: list[tuple[Arm, int]] = []   # challengers still to try, with their direction
        self._tried: set[Arm] = set()
        self._duel: _Duel | None = None
        self._incumbent_windows: list[Measure] = []   # the incumbent's last windows, oldest first
        self._fresh = False                    # the last window was the incumbent's
        self._window = Measure()
        self._anchor: float | None = None      # the end of the round before the window's first
        self._last_round_at = 0.0
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

    def observe(self, drafted: int, whole: bool, tokens: int, ms: float, adaptive: bool, in_flight: int,
                now: float) -> None:
        """A round at this level that verified `drafted` drafts, yielded `tokens` and ended at
        `now` (seconds); `whole` where the request's end left its k whole."""
        self.rounds += adaptive
        if now - self._last_round_at > _PAUSE_S:
            self.restart_window(in_flight)
        self._last_round_at = now
        if self._skip > 0 or self._anchor is None:
            self._skip = max(self._skip - 1, 0)
            self._anchor = now
            return
        self._window.add(drafted, whole, tokens, ms, adaptive)
        span = now - self._anchor
        enough = max(_MIN_WINDOW_ROUNDS, _WINDOW_ROUNDS_PER_SEQUENCE * in_flight)
        rounds = self._window.rounds
        if span < _MIN_WINDOW_S or not (rounds >= enough or (span >= _MAX_WINDOW_S and rounds >= _MIN_WINDOW_ROUNDS)):
            return
        window, self._window, self._anchor = self._window, Measure(), now
        window.seconds = span
        if window.adaptive < _ADAPTIVE_SHARE * window.rounds:
            return                           # mostly fixed-k requests: it measured them, not the arm
        before = self.running
        self._tabulate(before, window)
        self._finished(window)
        if self.running != before:
            # their next rounds share batches with the old arm's, its pools' queues
            self._skip = _SETTLE_ROUNDS_PER_SEQUENCE * in_flight

    def restart_window(self, in_flight: int) -> None:
        """The load left this level or came back to it, or the level saw no round for a
        while: the window under way, which would count time without its tokens, is dropped,
        and so are the first rounds of every sequence back here (they meet a wave of fresh
        prefills and queues). The climb goes on where it was."""
        self._window, self._anchor = Measure(), None
        self._skip = _SETTLE_ROUNDS_PER_SEQUENCE * in_flight

    def _tabulate(self, arm: Arm, window: Measure) -> None:
        seen = self.table.get(arm)
        self.table[arm] = window if seen is None else seen.scaled(1 - _TABLE_WEIGHT) + window.scaled(_TABLE_WEIGHT)
        self.windows = (self.windows + [{"arm": arm.name, "rounds": int(window.rounds),
                                         "round_ms": round(window.round_ms(), 1), "span_s": round(window.seconds, 2),
                                         "tokens_per_s": round(window.tokens_per_s(self.keep), 1)}])[-12:]

    def _finished(self, window: Measure) -> None:
        duel = self._duel
        role = duel.plan.pop(0) if duel is not None else "incumbent"
        if role == "challenger":
            duel.windows.append(window)
            self._fresh = False
            return
        if self._incumbent_windows:
            before = self._incumbent_windows[-1]
            self._window_noise.add(math.log(window.tokens_per_s(self.keep) / before.tokens_per_s(self.keep)) ** 2)
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
        ratio = challenger.tokens_per_s(self.keep) / max(incumbent.tokens_per_s(self.keep), 1e-9)
        # The error of the log ratio: from the spread of the incumbent's own successive windows
        # (the machine's wandering speed, the traffic's), and from E(k)'s.
        per_window = self._window_noise.get(_PRIOR_WINDOW_NOISE ** 2) / 2
        spread = per_window / pairs + per_window / (pairs + 1)
        error = math.sqrt(spread + self.keep.relative_variance(duel.challenger.k)
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
        now = (window.round_ms(), self.keep.expected_tokens(self.incumbent.k))
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
        """Challengers of arm: the other kind of a hybrid request's drafts, one step down and
        one up the ladder, the other overlap, and the target alone (speculation must beat it,
        not only its neighbours); `only` keeps one direction (a climb does not go back the way
        it came)."""
        # The target alone is no kind of drafts: its other kind's nearest arm is the least k of it.
        lowest = min((a.k for a in self.arms if a.k), default=0)
        kind = [(Arm(max(arm.k, lowest), False, not arm.lookup), 0)] if only in (None, 0) else []
        # A hybrid choice asks first which kind of drafts pays at this load: the two differ by
        # far more than neighbouring k do (docs/BENCHMARKS.md), and a load's phase may be short.
        out = kind + [(self._step(arm, d), d) for d in (-1, 1) if only in (None, d)]
        twin = Arm(arm.k, not arm.overlap, arm.lookup)
        if only in (None, 0):
            out.append((twin, 0))
        if Arm(0) in self.arms and only in (None, -1) and self._alone_ratio >= 1 - 3 * MARGIN:
            out.append((Arm(0), _ALONE))
        seen, unique = set(self._tried), []
        for a, d in out:
            if a is not None and a in self.arms and a not in seen:
                seen.add(a)
                unique.append((a, d))
        return unique

    def _step(self, arm: Arm, direction: int) -> Arm | None:
        ks = sorted({a.k for a in self.arms})
        i = ks.index(arm.k) + direction
        if not 0 <= i < len(ks):
            return None
        same = Arm(ks[i], arm.overlap, arm.lookup)
        return same if same in self.arms else Arm(ks[i], False)

    def describe(self) -> dict:
        return {"choice": self.incumbent.name, "k": self.incumbent.k, "overlap": self.incumbent.overlap,
                "running": self.running.name, "settled": self.settled, "settled_after_rounds": self.settled_after,
                "rounds": self.rounds, "climbs": self.climbs, "changes": self.changes,
                "window_noise": round(math.sqrt(self._window_noise.get(_PRIOR_WINDOW_NOISE ** 2) / 2), 4),
                "last_duels": self.duels, "last_windows": self.windows,
                "tokens_per_s": {arm.name: round(m.tokens_per_s(self.keep), 1)
                                 for arm, m in sorted(self.table.items())}}


def _pooled(windows: list[Measure]) -> Measure:
    total = Measure()
    for window in windows:
        total = total + window
    return total


def ladder(min_k: int, max_k: int, k: int, overlap_auto: bool, lookup_twins: bool = False) -> list[Arm]:
    ks = sorted({v for v in _LADDER if min_k <= v <= max_k} | {min_k, max_k, k})
    arms = [Arm(v, o) for v in ks for o in ((False, True) if overlap_auto and v else (False,))]
    return arms + [Arm(v, False, True) for v in ks if lookup_twins and v]


class KController:
    """A router's adaptive choice: a LevelClimb per load level, the level from the load with
    hysteresis. Every round of the router (fixed-k ones too) counts in its level's windows
    and the keep chances; only windows of mostly adaptive rounds move a climb."""

    def __init__(self, min_k: int, max_k: int, start_k: int, overlap: bool | str = False, hybrid: bool = False):
        """hybrid: the choice of hybrid requests, whose arms also say whether the draft pool
        takes part; their rounds draft two kinds with different keep chances, so a round
        counts the tokens it yielded rather than E(k) of one kind's chances."""
        self.min_k, self.max_k = min_k, max_k
        self.overlap_auto = overlap == "auto"
        self.default_overlap = overlap is True
        self.hybrid = hybrid
        self.arms = ladder(min_k, max_k, start_k, self.overlap_auto, lookup_twins=hybrid)
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
            for level in (self._level, level_of(in_flight)):
                if level in self.levels:
                    self.levels[level].restart_window(in_flight)
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
        return Arm(k, arm.overlap and self.overlap_auto and k > 0, arm.lookup and k > 0)

    def overlap_for(self, arm: Arm) -> bool:
        return arm.overlap if self.overlap_auto else self.default_overlap

    def observe(self, level: int, drafted: int, accepted: int, round_ms: float, model_ms: float,
                in_flight: int, adaptive: bool, whole: bool, now: float | None = None,
                tokens: int | None = None, mine: bool = True) -> None:
        """A finished round at `level` that verified `drafted` drafts and yielded `tokens`
        (accepted + 1 unless its call ran further single-token steps); `whole` is false where
        the request's end cut its k short (it counts what it yielded, not E(k)). `mine`:
        its drafts were of the kind this controller chooses k for (a router keeps one for
        the draft pool's drafts and one for lookup drafts); another kind's round shares the
        machine, so it counts in the level's window, with its own tokens, but moves no climb
        and no keep chance."""
        if mine and drafted:
            self.keep.observe(drafted, accepted)
        if mine:
            self.prior.observe(bool(drafted), round_ms, model_ms)
        self.climb(level).observe(drafted, whole and mine and not self.hybrid,
                                  accepted + 1 if tokens is None else tokens, round_ms,
                                  adaptive and mine, in_flight, time.monotonic() if now is None else now)

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
                **({"lookup_alone": self.current.lookup} if self.hybrid else {}),
                "load": self.load,
                "keep_chances": [round(h, 3) for h in self.keep.chances()],
                "levels": {level_name(level): climb.describe() for level, climb in sorted(self.levels.items())},
                "prior": self.prior.describe(ks, LEVEL_EDGES[self.level])}
