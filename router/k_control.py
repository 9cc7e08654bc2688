"""Choosing every round's drafts by goodput: how many (k), from where, and how many target
steps a verify call runs, so that speculation never costs throughput.

Terms (a router's sequences verify together: the target pool batches their calls):
- source: where a round's drafts come from: the draft pool ("pool"), or lookup in the router
  ("ngram", "suffix": free, already made when the choice is made, router/draft_sources.py).
- offer: what a sequence could verify this round: its lookup drafts (and the length of the
  match they came from) and whether the draft pool may draft for it.
- E_i(k): sequence i's expected tokens from a window of k drafts (router/goodput.py: its own
  keep chances, with its source's pooled chances as prior), each draft's part of its gain
  E_i(k) - 1 scaled by the share of what that position was expected to keep that its
  source's chosen rounds kept (GainCalibration). Greedy and sampled sequences pool apart:
  a sampled draft is kept with the target's probability of it, a greedy one whenever it
  is the target's top token, so on the same text they keep at different rates
  (the bench's suffix drafts, 2026-12-04: 56 % greedy, 14-24 % sampled); pooled together,
  a sampled sequence would start from the greedy rounds' chances and draft until its own
  rounds said otherwise.
- steps S: forward passes a verify call runs: the window's, then S - 1 single-token steps on
  every row (the target alone's next tokens). Every row of the batch takes the same S: the
  batch waits for its longest call, so a row that stopped early would only wait.
- round time T (ms, router/cost_model.py): coordination C(d) + c_draft sum(k_i) (d: whether
  the round makes a draft call; c_draft: what a draft adds to a round's coordination, fitted
  from the rounds' times) + the window's pass over R rows and sum(k_i + 1) positions + S - 1
  passes of R single positions + the draft pool's k_max passes where d.
- goodput G = (sum_i E_i(k_i) + R (S - 1)) / T: tokens per ms of the whole batch.

The choice maximises G over every k_i, S and d. T is linear in the k_i (each draft adds its
position to the window's pass, and its share of the draft pool's steps), so for a given
rate lambda the problem splits: each sequence takes the k maximising E_i(k) - lambda *
(its k's added ms), and lambda <- G of that choice, repeated (Dinkelbach's method for a
ratio; it converges in a few steps from the last plan's lambda). S and d, shared by the
batch, are enumerated. A plan is made once per batch round (when a sequence's round starts
and as many rounds as there are sequences went by since the last one, or the load changed); each
sequence then decides at its round's start with the plan's lambda, S and d and its own
offer of that round (a lookup match it did not have at plan time is priced then). Lambda is
what makes it a batch decision: a draft must buy more tokens than the batch would make in
the time its position costs.

Exploration: every EXPLORE_EVERY-th plan (and three times sooner after a start), a quarter
of the sequences (another quarter each time) that would verify no drafts draft two,
so acceptance that improved and costs that fell are seen again; a sequence's own evidence
fades round by round (router/goodput.py), so one that stopped drafting is tried again when
its source's pooled chances say it would pay.

Settling: after a load change (the sequences in flight moved by more than a quarter), the
plans until the choice (S, d, the mean k within SETTLED_K_SPREAD) stays the same for
SETTLED_PLANS plans in a row; describe() reports the last few.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

from router.cost_model import PassShape, RoundCosts
from router.goodput import GainCalibration, KeepChances, SequenceKeep, expected_curve

POOL = "pool"
LOOKUP_SOURCES = ("ngram", "suffix")
_MATCH_BUCKETS = 4              # lookup chances pooled by match length 1, 2, 3, 4+
EXPLORE_EVERY = 32
_EARLY_EXPLORATION = (4, 8, 16)   # a fresh router's cost model has seen one shape: widen it soon
_EXPLORE_K = 2
_EXPLORE_SHARE = 4              # one sequence in this many explores on an exploration plan
SETTLED_PLANS = 10
SETTLED_K_SPREAD = 0.75
_LOAD_CHANGE = 0.25
_DINKELBACH_STEPS = 8
_RECENT_ROUNDS = 256            # the k distribution describe() shows
_OVERLAP_MARGIN = 0.02
MAX_MARGIN = 0.5
# Rounds a source's pooled first chance must have seen before its chosen rounds calibrate its
# gains: until then the chances are the prior's, and what a start's first rounds expected
# says nothing of how the choice overstates them later.
CALIBRATION_EVIDENCE = 10


@dataclass(frozen=True)
class Offer:
    lookup: tuple[int, ...] = ()       # lookup drafts ready for this round (up to max_k)
    lookup_source: str | None = None   # "ngram" or "suffix"
    match: int = 0                     # length of the match the lookup drafts came from
    pool: bool = False                 # the draft pool may draft for this sequence
    fallback: bool = False             # the method drafts from the pool, which cannot serve: lookup instead


@dataclass(frozen=True)
class Choice:
    source: str | None     # POOL, a lookup source, or None: no drafts
    k: int
    steps: int
    predicted_ms: float    # the plan's round time


@dataclass
class Plan:
    rate: float            # lambda: tokens per ms of the batch
    steps: int
    draft_call: bool
    rows: int
    predicted_ms: float
    mean_k: float
    explore: bool = False

    def holds(self, earlier: "Plan | None") -> bool:
        """The same choice as `earlier`, for settling: steps, draft call, and mean k within
        SETTLED_K_SPREAD."""
        return (earlier is not None and (self.steps, self.draft_call) == (earlier.steps, earlier.draft_call)
                and abs(self.mean_k - earlier.mean_k) <= SETTLED_K_SPREAD)


@dataclass
class _Sequence:
    # its own keep chances per source, made at the source's first use: one never drafted from
    # holds no evidence, which is what decaying a fresh one's zeros would leave
    keep: dict[str, SequenceKeep]
    index: int = 0                 # its order of arrival at this router
    sampled: bool = False          # its keep chances pool with the other sampled sequences'
    context: int = 0
    offer: Offer = Offer()            # its last round's: what the next plan prices it with
    chosen: tuple[str, int, tuple[float, ...]] | None = None   # this round's source, k, P(draft j kept)
    drafts: int = 0                # its latest round's drafts, in flight until its next round


@dataclass
class _Option:
    source: str | None
    k: int
    gain: float            # tokens beyond the window's one: E(k) - 1, calibrated
    cost: float            # ms the k drafts add to the round
    expected: tuple[float, ...] = ()   # P(draft j kept), j = 1..k, as the keep chances say


class GoodputController:
    """One per router: every sequence of every method, since they share the target's batches."""

    def __init__(self, max_k: int, min_k: int = 0, max_steps: int = 1, explore_every: int = EXPLORE_EVERY):
        self.max_k, self.min_k, self.max_steps = max_k, min_k, max(1, max_steps)
        self.explore_every = explore_every
        self.costs = RoundCosts()
        self._pooled: dict[tuple[str, bool, int], KeepChances] = {}   # (source, sampled, match bucket)
        self._calibration: dict[tuple[str, bool], GainCalibration] = {}   # (source, sampled)
        self._sequences: dict[str, _Sequence] = {}
        self._plan: Plan | None = None
        self._rounds_since_plan = 0
        self._arrivals = 0
        self.plans = 0
        self._seen_batches: dict[str, deque[str]] = {"target": deque(maxlen=64), "draft": deque(maxlen=64)}
        self._recent: deque[tuple[str, int]] = deque(maxlen=_RECENT_ROUNDS)   # (method, k) of recent rounds
        # settling after load changes
        self._load_at_change: int | None = None
        self._plans_since_change = 0
        self._stable_since: int | None = None
        self._stable_start: Plan | None = None     # the first plan of the run of plans holding the same choice
        self._stable_plans = 0
        self.load_changes = 0
        self.rounds_to_settle: deque[int] = deque(maxlen=8)
        self._settling = False
        self._drafts_in_flight = 0     # every sequence's latest round's drafts (router/cost_model.py)
        # What every sequence's round prices with, worked out once per plan: the router does
        # this work between a batch's rounds, so its microseconds a sequence delay the batch
        self._per_plan: dict[tuple, object] = {}

    # sequences ---------------------------------------------------------------------------

    def begin(self, seq_id: str, sampled: bool = False) -> None:
        self._arrivals += 1
        self._sequences[seq_id] = _Sequence({}, self._arrivals, sampled)

    def end(self, seq_id: str) -> None:
        seq = self._sequences.pop(seq_id, None)
        if seq is not None:
            self._drafts_in_flight -= seq.drafts

    @property
    def in_flight(self) -> int:
        return len(self._sequences)

    # the choice ----------------------------------------------------------------------------

    def may_draft(self, seq_id: str, source: str, context: int) -> bool:
        """Whether any k > 0 from `source` could pay for seq_id this round: E(k) - 1 is at most
        k h_1 (every later chance is at most 1), so where even its best first chance (over the
        match lengths) buys fewer tokens than the batch makes in that draft's time, no k does,
        and the offer (a lookup's work in the router) need not be made. A sequence exploring
        this round always may."""
        plan = self._current_plan()
        seq = self._sequence(seq_id)
        if self._explores(plan, seq) or self.min_k > 0:
            return True
        first = self._keep(seq, source).first_chance(self._best_first_prior(source, seq.sampled))
        return first * self._kept_shares(source, seq.sampled)[0] > \
            self._draft_price(plan) * self._draft_ms(context, source == POOL)

    def _best_first_prior(self, source: str, sampled: bool) -> float:
        """The highest optimistic first chance of the source's pooled chances over the match
        lengths (1 before any were seen): a sequence's first chance rises with its prior, so
        this prior gives its best one. Once per plan."""
        key = ("first", source, sampled)
        best = self._per_plan.get(key)
        if best is None:
            best = self._per_plan[key] = max((pooled.optimistic()[0] for (each, pooled_sampled, _), pooled
                                              in self._pooled.items() if each == source and pooled_sampled == sampled),
                                             default=1.0)
        return best

    def choose(self, seq_id: str, offer: Offer, context: int, cap: int, method: str = "") -> Choice:
        """This round's drafts for seq_id: source, k (within `cap`, the drafts the request's
        end leaves room for) and the verify call's steps."""
        seq = self._sequence(seq_id)
        seq.context, seq.offer = context, offer
        plan = self._current_plan()
        explores = self._explores(plan, seq)
        if offer.pool and not offer.lookup and not explores and not self.may_draft(seq_id, POOL, context):
            offer = seq.offer = Offer()       # a pool draft cannot pay: nothing to price
        price = self._draft_price(plan)
        best = max(self._options(seq, offer, plan.draft_call, cap), key=lambda o: o.gain - price * o.cost)
        if best.k < self.min_k or (explores and best.k == 0):
            best = self._forced(seq, offer, cap, max(self.min_k, _EXPLORE_K)) or best
        steps = max(1, min(plan.steps, cap + 1 - best.k))
        calibrates = best.k and self._calibrates(seq, best.source, offer)
        seq.chosen = (best.source, best.k, best.expected) if calibrates else None
        self._recent.append((method, best.k))
        return Choice(best.source, best.k, steps, plan.predicted_ms)

    def _explores(self, plan: Plan, seq: _Sequence) -> bool:
        """Whether seq explores this round: on an exploration plan, a quarter of the sequences
        (in turn, by their place among the router's: each exploration plan another quarter),
        so that one costs the batch a quarter of the positions it would if all explored."""
        return plan.explore and (seq.index + self.plans // self.explore_every) % _EXPLORE_SHARE == 0

    def steps(self, k: int, cap: int) -> int:
        """The verify call's steps for a round whose k was fixed by its request."""
        return max(1, min(self._current_plan().steps, cap + 1 - k))

    def overlap_pays(self, seq_id: str, k: int) -> bool:
        """Whether drafting the next window during this one's verify (router/lookahead.py) is
        expected to pay: the draft call it saves when the whole window and the guess hold
        (h_1 ... h_k h_(k+1) of the pool's pooled chances), against OVERLAP_MARGIN of the
        round. It does not price the lookahead's own draft work, which on machines where the
        pools share cores slows the verify beside it (docs/BENCHMARKS.md)."""
        chances = self._pooled_chances(POOL, 0, self._sequence(seq_id).sampled).chances()
        hit = math.prod(chances[:k + 1])
        draft = self.costs.draft.predict(PassShape(self.in_flight or 1, self.in_flight or 1, 0.0))
        saved = hit * (k * draft + self.costs.coordination_ms(True) - self.costs.coordination_ms(False))
        plan = self._plan
        return plan is not None and saved > _OVERLAP_MARGIN * plan.predicted_ms

    def _forced(self, seq: _Sequence, offer: Offer, cap: int, k: int) -> _Option | None:
        """At least k drafts from the best source offered (min_k, or exploration)."""
        options = [o for o in self._options(seq, offer, True, cap) if o.k >= min(k, cap)]
        return max(options, key=lambda o: o.gain / max(o.k, 1)) if options else None

    def _options(self, seq: _Sequence, offer: Offer, draft_call: bool, cap: int) -> list[_Option]:
        options = [_Option(None, 0, 0.0, 0.0)]
        limit = min(self.max_k, max(cap, 0))
        if offer.lookup and offer.lookup_source is not None:
            options += self._source_options(seq, offer.lookup_source, offer.match, min(len(offer.lookup), limit))
        if offer.pool and draft_call:
            options += self._source_options(seq, POOL, 0, limit)
        return options

    def _source_options(self, seq: _Sequence, source: str, match: int, limit: int) -> list[_Option]:
        if limit <= 0:
            return []
        curve = self._curve(seq, source, match, limit)
        per_draft = self._draft_ms(seq.context, source == POOL)
        kept = [curve[j] - curve[j - 1] for j in range(1, limit + 1)]      # P(draft j kept)
        shares = self._kept_shares(source, seq.sampled)
        options, gain = [], 0.0
        for k in range(1, limit + 1):
            gain += kept[k - 1] * shares[k - 1]
            options.append(_Option(source, k, gain, k * per_draft, tuple(kept[:k])))
        return options

    def _curve(self, seq: _Sequence, source: str, match: int, limit: int) -> list[float]:
        prior = self._pooled_chances(source, match, seq.sampled).optimistic()[:limit]
        return expected_curve(self._keep(seq, source).chances(prior))

    def margin(self) -> float:
        """How much more a draft must buy than its predicted time is worth: the controller's
        own measured error, the mean |log(measured / predicted)| of its rounds' times (at most
        MAX_MARGIN). Drafting pays only by the difference between two predictions, while
        verifying no drafts is the target alone's own round: where the predictions are off by
        a fifth, a draft that the model says gains 10 % is as likely a loss. (Measured
        2026-12-05, sampled at 8-32 clients, drafts kept a third of the time: the default ran
        0.89-0.96x the target alone with this margin, 0.91-0.97x without it: within the
        machine's noise, docs/BENCHMARKS.md.)"""
        error = self.costs.round_error.value
        return 0.0 if error is None else min(error, MAX_MARGIN)

    def _draft_price(self, plan: Plan) -> float:
        """Tokens a draft's predicted ms must buy: the batch's rate, marked up by the margin."""
        return plan.rate * (1 + self.margin())

    def _draft_ms(self, context: int, pool: bool) -> float:
        """ms one more draft adds to a round: its position in the target's window pass, for
        a pool draft one row of one of the draft pool's passes with its share of the pass's
        fixed cost, and what a draft in flight adds to the round's coordination (c_draft,
        router/cost_model.py). Its terms once per plan."""
        key = ("draft_ms", pool)
        terms = self._per_plan.get(key)
        if terms is None:
            target = self.costs.target.theta
            fixed, per_kilo_context = self.costs.in_flight.ms + max(target[2], 0.0), max(target[3], 0.0)
            if pool:
                draft = self.costs.draft.theta
                fixed += max(draft[0], 0.0) / max(self.in_flight, 1) + max(draft[1], 0.0) + max(draft[2], 0.0)
                per_kilo_context += max(draft[3], 0.0)
            terms = self._per_plan[key] = (fixed, per_kilo_context)
        return terms[0] + terms[1] * context / 1000

    # plans -----------------------------------------------------------------------------------

    def _current_plan(self) -> Plan:
        """The plan, made again once per batch round (as many rounds as sequences ended since
        the last one) or when the load changed."""
        rows = max(self.in_flight, 1)
        plan = self._plan
        if plan is None or plan.rows != rows or self._rounds_since_plan >= rows:
            self._per_plan = {}
            plan = self._plan = self._make_plan(rows, plan.rate if plan is not None else None)
            self._rounds_since_plan = 0
            self._note_plan(plan)
        return plan

    def _make_plan(self, rows: int, rate: float | None) -> Plan:
        """The S, d and lambda that maximise the batch's goodput, given each sequence's offer
        as last seen (a sequence that has not rounded yet counts as one with nothing offered)."""
        self.plans += 1
        seqs = list(self._sequences.values()) or [_Sequence({})]
        window = self.costs.target.predict(PassShape(rows, rows, sum(s.context for s in seqs) / 1000))
        step = window
        options = [self._options(s, s.offer, True, self.max_k) for s in seqs]
        pooled = any(o.source == POOL for each in options for o in each)
        best: Plan | None = None
        for draft_call in (False, True) if pooled else (False,):
            hulls = [_upper_hull(each if draft_call else [o for o in each if o.source != POOL]) for each in options]
            # Goodput is a ratio of two functions linear in S for given k: monotone in S, so
            # the best S is one of the ends.
            for steps in sorted({1, self.max_steps}):
                fixed = self.costs.coordination_ms(draft_call) + window + (steps - 1) * step
                lam, chosen = _dinkelbach(hulls, rows * steps, fixed, rate, 1 + self.margin())
                if best is None or lam > best.rate * (1 + 1e-9):
                    best = Plan(lam, steps, draft_call and any(o.source == POOL for o in chosen), rows,
                                fixed + sum(o.cost for o in chosen), sum(o.k for o in chosen) / len(chosen))
        best.explore = self.explore_every > 0 and (self.plans % self.explore_every == 0
                                                   or self.plans in _EARLY_EXPLORATION)
        return best

    def _note_plan(self, plan: Plan) -> None:
        """Settling: plans from a load change until the choice holds SETTLED_PLANS in a row."""
        last = self._load_at_change
        if last is None or abs(plan.rows - last) > max(1, _LOAD_CHANGE * last):
            self._load_at_change, self._plans_since_change = plan.rows, 0
            self._stable_start, self._stable_plans, self._settling = None, 0, True
            self.load_changes += 1
        self._plans_since_change += 1
        if plan.holds(self._stable_start):
            self._stable_plans += 1
        else:
            self._stable_start, self._stable_plans = plan, 1
            self._stable_since = self._plans_since_change
        if self._settling and self._stable_plans >= SETTLED_PLANS:
            self.rounds_to_settle.append(self._stable_since - 1)
            self._settling = False

    # observations ----------------------------------------------------------------------------

    def observe_round(self, seq_id: str, source: str | None, drafted: int, accepted: int, match: int = 0) -> None:
        """A round of seq_id verified `drafted` drafts from `source` and kept `accepted`."""
        self._rounds_since_plan += 1
        seq = self._sequences.get(seq_id)
        if seq is not None:
            self._drafts_in_flight += drafted - seq.drafts
            seq.drafts = drafted
        if seq is not None and seq.chosen is not None and seq.chosen[:2] == (source, drafted):
            self._calibration.setdefault((source, seq.sampled), GainCalibration(self.max_k)).observe(
                list(seq.chosen[2]), accepted)
        if drafted and source is not None:
            self._pooled_chances(source, match, seq is not None and seq.sampled).observe(drafted, accepted)
        if seq is None:
            return
        seq.chosen = None
        if drafted and source is not None:
            self._keep(seq, source)
        for each, keep in seq.keep.items():
            keep.observe(drafted if each == source else 0, accepted)

    def observe_timing(self, draft_call: bool, wall_ms: float, engine_ms: float, predicted_ms: float | None) -> None:
        """A round's wall time at the router and its calls' engine time, after observe_round
        (which counted its drafts among those in flight)."""
        self.costs.observe_round(draft_call, wall_ms, engine_ms, predicted_ms, self._drafts_in_flight)

    def observe_passes(self, pool: str, batch_id: str, passes) -> None:
        """A pool's batch, reported with every row it answered: counted once. The target's
        passes with more positions than their rows could verify are left out: they hold a
        prompt's prefill, which the target runs whether or not anyone drafts, and the choice
        prices its verify windows and steps only. Prefills are where a CPU's forward is most
        efficient a position (its weights read once for many); fitted together with the
        windows they made a drafted position look a third of what it cost (the default
        cluster at 8 sampled clients, 2026-12-07: 0.05 ms a position fitted, where rounds that
        drafted a token a row took 0.33 ms of engine time more a draft). The draft pool's
        prefills stay in its fit: it prefills a prompt only because the sequence drafts there
        (left out, draft_model drafted at 8 greedy clients and ran 0.60x the target alone)."""
        if not batch_id or batch_id in self._seen_batches[pool]:
            return
        self._seen_batches[pool].append(batch_id)
        target = pool == "target"
        model = self.costs.target if target else self.costs.draft
        model.observe_all([(PassShape(rows, positions, attention), ms) for rows, positions, attention, ms in passes
                           if not target or positions <= rows * (self.max_k + 1)])

    def anchor(self, pool: str, passes) -> None:
        """A replica's start-up passes (replicas/deployments.py), once per pool."""
        model = self.costs.target if pool == "target" else self.costs.draft
        model.anchor_on([(PassShape(rows, positions, attention), ms) for rows, positions, attention, ms in passes])

    def _calibrates(self, seq: _Sequence, source: str, offer: Offer) -> bool:
        """Whether a round's expectation is the chances' own and not yet the prior's."""
        match = offer.match if source == offer.lookup_source else 0
        return self._pooled_chances(source, match, seq.sampled).looked[1] >= CALIBRATION_EVIDENCE

    def _kept_shares(self, source: str, sampled: bool) -> list[float]:
        """Per draft position, of the drafts from `source` the controller's chosen rounds
        expected to keep, the share they kept (router/goodput.py, GainCalibration)."""
        calibration = self._calibration.get((source, sampled))
        return [1.0] * self.max_k if calibration is None else calibration.shares()

    def _pooled_chances(self, source: str, match: int, sampled: bool) -> KeepChances:
        bucket = 0 if source == POOL else min(max(match, 1), _MATCH_BUCKETS)
        keep = self._pooled.get((source, sampled, bucket))
        if keep is None:
            keep = self._pooled[(source, sampled, bucket)] = KeepChances(self.max_k)
        return keep

    def _keep(self, seq: _Sequence, source: str) -> SequenceKeep:
        keep = seq.keep.get(source)
        if keep is None:
            keep = seq.keep[source] = SequenceKeep(self.max_k)
        return keep

    def _sequence(self, seq_id: str) -> _Sequence:
        if seq_id not in self._sequences:
            self.begin(seq_id)
        return self._sequences[seq_id]

    # views -----------------------------------------------------------------------------------

    def describe(self) -> dict:
        plan = self._plan
        by_method: dict[str, Counter] = {}
        for method, k in self._recent:
            by_method.setdefault(method, Counter())[k] += 1
        return {
            "in_flight": self.in_flight, "plans": self.plans,
            "plan": None if plan is None else {
                "tokens_per_s": round(plan.rate * 1000, 1), "steps": plan.steps, "draft_call": plan.draft_call,
                "rows": plan.rows, "mean_k": round(plan.mean_k, 2), "predicted_round_ms": round(plan.predicted_ms, 2)},
            "draft_margin": round(self.margin(), 3),
            "kept_share": {source + ("/sampled" if sampled else ""): [round(share, 3) for share in calibration.shares()]
                           for (source, sampled), calibration in sorted(self._calibration.items())},
            "k_by_method": {method: dict(sorted(counts.items())) for method, counts in sorted(by_method.items())},
            "keep_chances": {f"{source}" + ("/sampled" if sampled else "") + (f"/match{bucket}" if source != POOL else ""):
                             [round(h, 3) for h in keep.chances()]
                             for (source, sampled, bucket), keep in sorted(self._pooled.items())},
            "costs": self.costs.describe(), "round_ms": self.costs.round_ms(),
            "settling": {"load_changes": self.load_changes, "settling_now": self._settling,
                         "rounds_to_settle": list(self.rounds_to_settle)},
        }


def _upper_hull(options: list[_Option]) -> list[_Option]:
    """The options that can be best for some rate: the upper concave hull of (cost, gain),
    cheapest first (the k = 0 option has cost 0 and gain 0)."""
    points = sorted(options, key=lambda o: (o.cost, -o.gain))
    hull: list[_Option] = []
    for option in points:
        if hull and option.gain <= hull[-1].gain:
            continue                       # costs as much or more and gains no more
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], option) >= 0:
            hull.pop()
        hull.append(option)
    return hull


def _cross(a: _Option, b: _Option, c: _Option) -> float:
    return (b.cost - a.cost) * (c.gain - a.gain) - (b.gain - a.gain) * (c.cost - a.cost)


def _best_on(hull: list[_Option], rate: float) -> _Option:
    """The option maximising gain - rate * cost (the hull's gains rise ever more slowly)."""
    best = hull[0]
    for option in hull[1:]:
        if option.gain - rate * option.cost > best.gain - rate * best.cost:
            best = option
        else:
            break
    return best


def _dinkelbach(hulls: list[list[_Option]], base_tokens: float, fixed_ms: float,
                rate: float | None, markup: float = 1.0) -> tuple[float, list[_Option]]:
    """max over one option per hull of (base_tokens + sum gain) / (fixed_ms + sum cost), the
    options' costs marked up by `markup` while choosing (GoodputController.margin); the rate
    returned is the choice's at its costs as predicted."""
    fixed_ms = max(fixed_ms, 1e-6)
    lam = rate if rate is not None and rate > 0 else base_tokens / fixed_ms
    chosen = [hull[0] for hull in hulls]
    for _ in range(_DINKELBACH_STEPS):
        chosen = [_best_on(hull, lam * markup) for hull in hulls]
        new = (base_tokens + sum(o.gain for o in chosen)) / (fixed_ms + sum(o.cost for o in chosen))
        if math.isclose(new, lam, rel_tol=1e-6):
            lam = new
            break
        lam = new
    return lam, chosen
