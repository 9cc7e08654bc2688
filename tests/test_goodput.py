"""What a round should yield (router/goodput.py): keep chances measured per position, and the
cost model that is only the measured choice's prior (router/k_control.py)."""

from __future__ import annotations

import pytest

from router.goodput import CostModel, CostProfile, KeepChances

MEMORY_BOUND = CostProfile(fixed_ms=20.0, per_position_ms=0.01)     # a GPU target: k + 1 positions ~ 1 step
COMPUTE_BOUND = CostProfile(fixed_ms=1.0, per_position_ms=1.0)      # a verify costs its positions
CHEAP_DRAFT = CostProfile(fixed_ms=1.0, per_position_ms=0.01)
KS = [0, 1, 2, 4, 6, 8]


def test_keep_chances_are_conditional_on_the_drafts_before():
    # half the rounds keep nothing, half keep all 4: draft 1 is kept half the time, drafts
    # 2..4 always once draft 1 was (a single rate of 0.5 would predict 1.9 tokens, not 3)
    keep = KeepChances(8)
    for i in range(400):
        keep.observe(4, 4 if i % 2 else 0)
    chances = keep.chances()
    assert chances[0] == pytest.approx(0.5, abs=0.05)
    assert all(h > 0.9 for h in chances[1:4])
    assert keep.expected_tokens(4) == pytest.approx(3.0, abs=0.15)
    assert keep.expected_tokens(0) == 1.0


def test_keep_chances_follow_a_change_of_traffic():
    keep = KeepChances(4)
    for _ in range(400):
        keep.observe(4, 4)
    assert keep.expected_tokens(4) > 4.5
    for _ in range(600):
        keep.observe(4, 0)
    assert keep.expected_tokens(4) < 1.2


def model(target: CostProfile, keep_all: bool, rounds: int = 200) -> CostModel:
    keep = KeepChances(8)
    for i in range(rounds):
        keep.observe(8, 8 if keep_all and i % 10 else 0)
    prior = CostModel(keep, {"target": target, "draft": CHEAP_DRAFT})
    prior.observe(True, 4.0, 0.0)
    prior.observe(False, 2.0, 0.0)
    return prior


def test_the_prior_speculates_far_on_a_memory_bound_target_with_a_good_draft():
    assert model(MEMORY_BOUND, keep_all=True).best_k(1, KS) >= 6


def test_the_prior_turns_speculation_off_on_a_compute_bound_target_under_load():
    assert model(COMPUTE_BOUND, keep_all=True).best_k(16, KS) == 0


def test_the_prior_does_not_draft_what_is_never_kept():
    assert model(MEMORY_BOUND, keep_all=False).best_k(1, KS) == 0


def test_the_prior_waits_for_both_profiles():
    prior = CostModel(KeepChances(4), {"target": MEMORY_BOUND})
    assert not prior.ready and prior.best_k(1, KS) is None and prior.describe(KS, 1)["predicted_tokens_per_s"] == {}


def test_a_cost_profile_fit_recovers_a_linear_cost():
    table = {"rows": [1, 2, 4], "positions": [1, 3, 5],
             "ms": [[2.0 + 0.5 * r * n for n in (1, 3, 5)] for r in (1, 2, 4)]}
    fit = CostProfile.from_describe({"cost_profile_ms": table})
    assert fit.fixed_ms == pytest.approx(2.0) and fit.per_position_ms == pytest.approx(0.5)
    assert fit.forward_ms(8, 5) == pytest.approx(22.0)
