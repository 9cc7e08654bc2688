"""The online cost model of a pool's passes (router/cost_model.py): least squares with
forgetting on (1, rows, positions, attention), pulled towards a slower fit and the replica's
start-up passes where the recent passes do not vary."""

from __future__ import annotations

import random

import pytest

from router.cost_model import PassCost, PassShape, RoundCosts


def truth(shape: PassShape) -> float:
    return 2.0 + 0.3 * shape.rows + 0.5 * shape.positions + 0.1 * shape.attention


def noisy(rng: random.Random, ms: float, noise: float = 0.1) -> float:
    return ms * (1 + rng.gauss(0, noise))


def test_it_recovers_a_linear_cost_from_passes_of_varied_shapes():
    rng, model = random.Random(0), PassCost()
    for _ in range(300):
        rows = rng.randint(1, 16)
        shape = PassShape(rows, rows * rng.randint(1, 5), rows * rng.uniform(0.1, 2))
        model.observe(shape, noisy(rng, truth(shape), 0.02))
    assert model.theta == pytest.approx([2.0, 0.3, 0.5, 0.1], abs=0.15)
    assert model.error.get(1.0) < 0.05


def test_it_follows_the_machine_getting_slower():
    rng, model = random.Random(1), PassCost()
    shapes = [PassShape(r, r * p, 0.0) for r in (1, 4, 8) for p in (1, 3)]
    for _ in range(50):
        for shape in shapes:
            model.observe(shape, noisy(rng, truth(shape), 0.02))
    for _ in range(40):                     # contention: everything 1.5x slower
        for shape in shapes:
            model.observe(shape, noisy(rng, 1.5 * truth(shape), 0.02))
    assert model.predict(PassShape(8, 24, 0.0)) == pytest.approx(1.5 * truth(PassShape(8, 24, 0.0)), rel=0.08)


def test_a_direction_the_recent_passes_do_not_vary_along_keeps_what_was_measured():
    # varied shapes first (or at start), then a long run where every row has one position:
    # what a second position costs must still be known
    rng, model = random.Random(2), PassCost()
    model.anchor_on([(shape, truth(shape)) for shape in (PassShape(1, 1, 0.0), PassShape(1, 4, 0.0),
                                                          PassShape(2, 2, 0.0), PassShape(2, 6, 0.0),
                                                          PassShape(4, 4, 0.0))])
    for _ in range(400):
        shape = PassShape(8, 8, 0.0)
        model.observe(shape, noisy(rng, truth(shape), 0.1))
    assert model.predict(PassShape(8, 40, 0.0)) == pytest.approx(truth(PassShape(8, 40, 0.0)), rel=0.1)


def test_no_coefficient_goes_below_zero():
    model = PassCost()
    for positions in range(1, 30):     # more positions, less time: noise, not hardware
        model.observe(PassShape(1, positions, 0.0), 10.0 - 0.1 * positions)
    assert all(c >= 0 for c in model.theta)


def test_coordination_is_a_rounds_time_beyond_its_engine_time_by_kind():
    costs = RoundCosts()
    assert costs.coordination_ms(True) > costs.coordination_ms(False) > 0     # before any round
    for _ in range(50):
        costs.observe_round(False, 12.0, 9.0)
    assert costs.coordination_ms(False) == pytest.approx(3.0)
    assert costs.coordination_ms(True) == pytest.approx(6.0)      # unseen: a draft hop doubles the hops
    for _ in range(50):
        costs.observe_round(True, 20.0, 15.0, predicted_ms=20.0)
    assert costs.coordination_ms(True) == pytest.approx(5.0)
    assert costs.round_ms() == {"predicted": 20.0, "measured": 20.0}


def test_a_round_with_a_draft_call_is_never_priced_below_one_without():
    """Rounds that drafted can measure less coordination than rounds that did not (they
    came at other moments of the load), but the draft call only adds a hop: taken as
    measured, a draft call would look like a saving and the controller would draft for it."""
    costs = RoundCosts()
    for _ in range(50):
        costs.observe_round(False, 50.0, 8.0)
        costs.observe_round(True, 40.0, 9.0)
    assert costs.coordination_ms(False) == pytest.approx(42.0)
    assert costs.coordination_ms(True) == pytest.approx(42.0)


def _rounds_with_drafts_in_flight(per_draft_ms: float, seed: int, rounds: int = 3000) -> RoundCosts:
    """Rounds whose coordination is 3 ms plus per_draft_ms a draft in flight (a cost no pass
    shows), with 20 % noise, while a level that has nothing to do with the drafts (the load
    changing) drifts from 0 to 10 ms over the run and the drafts in flight from about 10 to
    30 with it."""
    costs = RoundCosts()
    rng = random.Random(seed)
    for r in range(rounds):
        drift = r / rounds
        drafts = max(0, round(rng.gauss(10 + 20 * drift, 4)))
        coordination = (3.0 + per_draft_ms * drafts) * rng.lognormvariate(0, 0.2) + 10 * drift
        costs.observe_round(False, 40.0 + coordination, 40.0, drafts_in_flight=drafts)
    return costs


def test_what_a_draft_in_flight_adds_to_a_rounds_coordination_is_fitted_from_the_rounds():
    assert RoundCosts().in_flight.ms == 0.0          # before any round: the passes' price alone
    costs = _rounds_with_drafts_in_flight(0.5, seed=3)
    assert costs.in_flight.ms == pytest.approx(0.5, rel=0.2)
    # C(d) is a round's coordination with no drafts in flight: 3 ms and the drift's 10
    assert costs.coordination_ms(False) == pytest.approx(13.0, rel=0.2)
    assert _rounds_with_drafts_in_flight(1.2, seed=4).in_flight.ms == pytest.approx(1.2, rel=0.2)
    # a level that drifts as the drafts do is not taken for their cost
    assert _rounds_with_drafts_in_flight(0.0, seed=5).in_flight.ms < 0.1
