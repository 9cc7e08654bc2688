"""What a round should yield (router/goodput.py): keep chances measured per position, pooled
and per sequence."""

from __future__ import annotations

import pytest

from router.goodput import GainCalibration, KeepChances, SequenceKeep, expected_curve, expected_tokens


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


def test_a_sequence_whose_drafts_fail_sees_it_within_its_own_rounds():
    pooled = [0.9] * 8                    # its neighbours' drafts are kept
    own = SequenceKeep(8)
    assert own.chances(pooled)[0] == pytest.approx(0.9)      # nothing of its own yet: the pooled chances
    for _ in range(20):
        own.observe(4, 0)
    assert own.chances(pooled)[0] < 0.2
    assert expected_tokens(own.chances(pooled), 4) < 1.5 < 4.0 < expected_tokens(pooled, 4)


def test_a_sequence_that_stopped_drafting_drifts_back_to_the_pooled_chances():
    pooled = [0.8] * 8
    own = SequenceKeep(8)
    for _ in range(20):
        own.observe(4, 0)
    low = own.chances(pooled)[0]
    for _ in range(120):                   # rounds without drafts: its evidence fades
        own.observe(0, 0)
    assert low < 0.25 < 0.7 < own.chances(pooled)[0]


def test_expected_curve_is_e_of_every_k():
    chances = [0.5, 0.5, 1.0]
    assert expected_curve(chances) == [1.0, 1.5, 1.75, 2.0]
    assert [expected_tokens(chances, k) for k in range(4)] == expected_curve(chances)


def test_gain_calibration_measures_what_chosen_rounds_kept_against_what_they_expected():
    calibration = GainCalibration(max_k=4)
    # Chosen rounds of k = 2 expecting P(draft 1 kept) 0.8 and P(draft 2 kept) 0.6, which kept
    # half of that: draft 1 in 4 rounds of 10, draft 2 in 3.
    for round_ in range(400):
        calibration.observe([0.8, 0.6], accepted=2 if round_ % 10 < 3 else 1 if round_ % 10 < 4 else 0)
    shares = calibration.shares()
    assert shares[0] == pytest.approx(0.4 / 0.8, abs=0.03)
    assert shares[1] == pytest.approx(min(0.3 / 0.6, shares[0]), abs=0.03)
    assert shares[2] == shares[3] == shares[1]      # never drafted: no better than the position before


def test_a_position_no_round_drafts_any_more_fades_back_to_a_share_of_one():
    calibration = GainCalibration(max_k=4)
    for _ in range(200):
        calibration.observe([0.9, 0.9, 0.9, 0.9], accepted=0)
    assert max(calibration.shares()) < 0.1
    for _ in range(300):                    # drafting one a round now, and every one kept
        calibration.observe([0.5], accepted=1)
    assert calibration.shares()[0] == 1.0
    assert calibration.shares()[3] > 0.9
