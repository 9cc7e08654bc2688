"""Goodput control (router/goodput.py): k follows measured acceptance and the cost of a round,
down to 0 where a verify costs as much as the decode steps it replaces; one k per router,
changed only for a clear gain."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.goodput import CostProfile, GoodputController, OverlapChoice


@dataclass
class Verification:
    accepted: int
    tokens: list
    batch_rows: int
    model_ms: float
    batch_positions: int


@dataclass
class Proposal:
    batch_rows: float
    model_ms: float
    steps: int


def controller(target: CostProfile, draft: CostProfile, max_k: int = 8, start_k: int = 4) -> GoodputController:
    control = GoodputController(min_k=0, max_k=max_k, start_k=start_k)
    control.profiles = {"target": target, "draft": draft}
    return control


def run_rounds(control: GoodputController, rounds: int, accepted_of: callable, rows: int, coordination_ms: float):
    """Rounds as the router would report them, costing exactly what the profiles say."""
    for i in range(rounds):
        k = control.choose(8)
        accepted = min(accepted_of(i, k), k)
        verify_ms = control.profiles["target"].forward_ms(rows, k + 1)
        draft_ms = k * control.profiles["draft"].forward_ms(rows, 1)
        verification = Verification(accepted, [0] * (accepted + 1), rows, verify_ms, rows * (k + 1))
        proposal = Proposal(rows, draft_ms, k) if k else None
        control.observe(k, accepted, coordination_ms + verify_ms + draft_ms, verification, proposal)


MEMORY_BOUND = CostProfile(fixed_ms=20.0, per_position_ms=0.01)     # a GPU target: k + 1 positions ~ 1 step
COMPUTE_BOUND = CostProfile(fixed_ms=1.0, per_position_ms=1.0)      # a verify costs its positions
CHEAP_DRAFT = CostProfile(fixed_ms=1.0, per_position_ms=0.01)


def test_a_memory_bound_target_with_a_good_draft_speculates_far():
    control = controller(MEMORY_BOUND, CHEAP_DRAFT)
    run_rounds(control, 200, lambda i, k: k if i % 10 else 0, rows=1, coordination_ms=2.0)
    assert control.k >= 6
    assert control.goodput(control.k) > 2 * control.goodput(0)


def test_a_compute_bound_target_under_load_turns_speculation_off():
    control = controller(COMPUTE_BOUND, CHEAP_DRAFT)
    run_rounds(control, 200, lambda i, k: k if i % 10 else 0, rows=16, coordination_ms=2.0)
    assert control.k == 0


def test_a_draft_that_is_never_accepted_is_not_asked():
    control = controller(MEMORY_BOUND, CHEAP_DRAFT)
    run_rounds(control, 200, lambda i, k: 0, rows=1, coordination_ms=2.0)
    assert control.k == 0


def test_keep_chances_are_conditional_on_the_drafts_before():
    # half the rounds keep nothing, half keep all 4: draft 1 is kept half the time, drafts
    # 2..4 always once draft 1 was (a single rate of 0.5 would predict 1.9 tokens, not 3)
    control = controller(MEMORY_BOUND, CHEAP_DRAFT)
    for i in range(400):
        accepted = 4 if i % 2 else 0
        control._count_kept(4, accepted)
    chances = control.keep_chances()
    assert chances[0] == pytest.approx(0.5, abs=0.05)
    assert all(h > 0.9 for h in chances[1:4])
    assert control.expected_tokens(4) == pytest.approx(3.0, abs=0.15)


def test_k_changes_only_for_a_clear_gain():
    control = controller(MEMORY_BOUND, CHEAP_DRAFT, start_k=6)
    run_rounds(control, 300, lambda i, k: k if i % 10 else 0, rows=1, coordination_ms=2.0)
    changes = control.changes
    best = max(range(0, 9), key=control.goodput)
    assert control.goodput(best) <= 1.05 * control.goodput(control.k)
    run_rounds(control, 300, lambda i, k: k if i % 10 else 0, rows=1, coordination_ms=2.0)
    assert control.changes - changes <= 1       # a steady load: no flapping


def test_a_cost_profile_fit_recovers_a_linear_cost():
    table = {"rows": [1, 2, 4], "positions": [1, 3, 5],
             "ms": [[2.0 + 0.5 * r * n for n in (1, 3, 5)] for r in (1, 2, 4)]}
    fit = CostProfile.from_describe({"cost_profile_ms": table})
    assert fit.fixed_ms == pytest.approx(2.0) and fit.per_position_ms == pytest.approx(0.5)
    assert fit.forward_ms(8, 5) == pytest.approx(22.0)


def overlap_rounds(choice: OverlapChoice, ms_by_mode: dict[bool, float], rounds: int, tokens: int = 3) -> list[bool]:
    """Rounds whose wall time depends on the mode the choice picks; the mode of each."""
    modes = []
    for _ in range(rounds):
        modes.append(choice.on)
        choice.observe(modes[-1], tokens, ms_by_mode[modes[-1]])
    return modes


def test_overlap_follows_the_faster_mode_and_a_change_of_load_at_the_next_probe():
    choice = OverlapChoice(start=True)
    # Few sequences: lookaheads hide drafting, rounds with overlap are shorter.
    assert sum(overlap_rounds(choice, {True: 10.0, False: 14.0}, 600)) > 0.8 * 600
    assert choice.on
    # Many sequences: lookaheads queue before drafts, overlap rounds get longer: the choice
    # turns within a few decisions, and stays turned but for probes.
    modes = overlap_rounds(choice, {True: 20.0, False: 14.0}, 1200)
    turned = modes.index(False)
    assert 64 < turned <= 576 and sum(modes[turned:]) < 0.15 * len(modes[turned:])   # probes only


def test_overlap_probes_the_other_mode_rarely_and_does_not_flap_on_small_differences():
    choice = OverlapChoice(start=False)
    on = sum(overlap_rounds(choice, {True: 14.0, False: 10.0}, 5000))
    assert not choice.on
    assert 0 < on < 0.15 * 5000                          # probed now and then, never kept
    steady = OverlapChoice(start=True)
    overlap_rounds(steady, {True: 10.0, False: 10.3}, 1000)   # 3 %: within the switching margin
    assert steady.switches == 2          # two probes, each kept: neither worth a switch back


def test_rounds_of_requests_that_fix_overlap_measure_without_deciding():
    choice = OverlapChoice(start=True)
    for _ in range(500):
        choice.observe(False, 3, 5.0, decides=False)     # a request that turned overlap off
        choice.observe(True, 3, 10.0, decides=False)
    assert choice.on and choice.switches == 0
    assert choice.goodput(False) == pytest.approx(0.6) and choice.goodput(True) == pytest.approx(0.3)
    choice.observe(True, 3, 10.0)
    for _ in range(80):                                  # one decision later
        choice.observe(choice.on, 3, 10.0 if choice.on else 5.0)
    assert not choice.on


def test_a_measure_taken_under_another_load_misleads_one_decision_at_most():
    choice = OverlapChoice(start=True)
    overlap_rounds(choice, {True: 10.0, False: 14.0}, 1000)
    # Heavier load: both modes slower, overlap still better. Rounds with overlap now look
    # worse than the old measure of rounds without it: one window runs without overlap,
    # is measured afresh, and the choice returns.
    modes = overlap_rounds(choice, {True: 20.0, False: 24.0}, 600)
    assert modes.count(False) <= 64 + 8 and choice.on
