"""k chosen by measured throughput (router/k_control.py), driven by simulated clusters: a
compute-bound target (a verify costs in proportion to its positions, as on this CPU) and a
memory-bound one (a verify costs about one step, as a large model on a GPU), round times with
20 % noise, tokens per round from a per-draft keep chance, and load that changes mid-run."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from router.k_control import Arm, KController, LevelClimb, Measure, ladder, level_name, level_of


@dataclass
class SimulatedCluster:
    """A round of k drafts over `load` sequences: tokens 1 + drafts kept (each kept with
    `keep` once the ones before it were), and wall time coordination + k draft steps + one
    verify of k + 1 positions per sequence, times lognormal noise."""
    verify_fixed_ms: float
    verify_per_position_ms: float
    draft_fixed_ms: float
    draft_per_row_ms: float
    keep: float
    coordination_ms: float = 2.0
    noise: float = 0.2
    overlap_saves: float = 0.0          # share of the draft time a lookahead hides
    drift: float = 0.0                  # sd of the machine's log speed, wandering over about a second
    seed: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.clock = 0.0                # seconds
        self._log_speed = 0.0

    def mean_ms(self, arm: Arm, load: int) -> float:
        draft = arm.k * (self.draft_fixed_ms + self.draft_per_row_ms * load)
        if arm.overlap:
            draft *= 1 - self.overlap_saves
        verify = self.verify_fixed_ms + self.verify_per_position_ms * load * (arm.k + 1)
        return self.coordination_ms * (2 if arm.k else 1) + draft + verify

    def expected_tokens(self, k: int) -> float:
        return sum(self.keep ** i for i in range(k + 1))

    def throughput(self, arm: Arm, load: int) -> float:
        """Tokens per second across the sequences, in expectation."""
        return self.expected_tokens(arm.k) / self.mean_ms(arm, load) * load * 1000

    def best(self, arms: list[Arm], load: int) -> Arm:
        return max(arms, key=lambda arm: self.throughput(arm, load))

    def round(self, arm: Arm, load: int) -> tuple[int, float]:
        """One sequence's round: its tokens and wall ms. `load` sequences round side by side,
        so the clock moves on by a load-th of it."""
        kept = 0
        while kept < arm.k and self.rng.random() < self.keep:
            kept += 1
        ms = self.mean_ms(arm, load) * math.exp(self.rng.gauss(0, self.noise) - self.noise ** 2 / 2 + self._log_speed)
        self.clock += ms / load / 1000
        pull = min(ms / load / 1000, 1.0)             # an AR(1) walk with a correlation time of 1 s
        self._log_speed += -pull * self._log_speed + self.drift * math.sqrt(2 * pull) * self.rng.gauss(0, 1)
        return kept + 1, ms


def compute_bound(**kw) -> SimulatedCluster:
    """Fitted to the default cluster on this 2-core CPU (docs/BENCHMARKS.md): the target alone
    about 75 tok/s at 1 client, 300 at 8, 420 at 32; k = 4 about 95 at 1 client."""
    return SimulatedCluster(verify_fixed_ms=8.0, verify_per_position_ms=2.0, draft_fixed_ms=2.0,
                            draft_per_row_ms=0.2, keep=0.75, coordination_ms=3.0, **kw)


def memory_bound(**kw) -> SimulatedCluster:
    """A large target on a GPU: a verify of k + 1 positions costs about one decode step."""
    return SimulatedCluster(verify_fixed_ms=25.0, verify_per_position_ms=0.02, draft_fixed_ms=1.5,
                            draft_per_row_ms=0.01, keep=0.85, **kw)


def drive(control: KController, cluster: SimulatedCluster, load: int, seconds: float) -> list[Arm]:
    """Rounds as a router reports them, for `seconds` of the cluster's clock; the arm of each."""
    arms, end = [], cluster.clock + seconds
    while cluster.clock < end:
        level = control.note_load(load)
        arm = control.choose(level, cap=64)
        tokens, ms = cluster.round(arm, load)
        control.observe(level, arm, arm.k, tokens - 1, ms, 0.0, load, adaptive=True, measured=True,
                        now=cluster.clock)
        arms.append(arm)
    return arms


def realised(cluster: SimulatedCluster, arms: list[Arm], load: int) -> float:
    """Throughput of a run of rounds (each arm's expected tokens over its expected time)."""
    tokens = sum(cluster.expected_tokens(arm.k) for arm in arms)
    ms = sum(cluster.mean_ms(arm, load) for arm in arms)
    return tokens / ms * load * 1000


def controller(overlap: bool | str = False, start_k: int = 4) -> KController:
    return KController(min_k=0, max_k=8, start_k=start_k, overlap=overlap)


def test_the_simulated_clusters_differ_as_their_hardware_does():
    arms = ladder(0, 8, 4, overlap_auto=False)
    assert compute_bound().best(arms, 16).k == 0            # verifying positions costs: no speculation
    assert compute_bound().best(arms, 1).k in (2, 4)        # one sequence: a little
    assert memory_bound().best(arms, 1).k == 8              # a verify costs one step: as far as allowed
    assert memory_bound().best(arms, 16).k == 8


@pytest.mark.parametrize("drift", [0.0, 0.1], ids=["steady", "drifting"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind,load", [("compute", 1), ("compute", 8), ("compute", 32), ("memory", 1),
                                       ("memory", 16)])
def test_it_settles_near_the_best_arm_within_a_bounded_number_of_rounds(kind, load, seed, drift):
    cluster = (compute_bound if kind == "compute" else memory_bound)(seed=seed, drift=drift)
    control = controller()
    arms = drive(control, cluster, load, 60.0)
    climb = control.levels[level_of(load)]
    best = cluster.best(control.arms, load)
    late = realised(cluster, arms[len(arms) // 2:], load)    # the last 30 s, rechecks included
    alone = cluster.throughput(Arm(0), load)
    if drift:
        # The machine's speed wanders by 10 % over seconds: more windows to tell arms apart,
        # and differences under about 15 % stay unresolved; even from a cold start at k = 4 it
        # stays within 7 % of the target alone.
        assert climb.settled_after is not None and climb.settled_after <= 2 * len(arms) / 3   # 40 s
        assert late >= max(0.85 * cluster.throughput(best, load), 0.93 * alone)
        return
    assert climb.settled_after is not None and climb.settled_after <= len(arms) / 2           # 30 s
    if kind == "compute" and load > 1:
        assert climb.incumbent.k <= 1        # verifying positions costs what decoding them does
    if kind == "memory":
        assert climb.incumbent.k >= 6        # a verify costs one step: draft far
    # within 6 %: the difference one-second windows of rounds with 20 % noise tell apart;
    # what the rounds got, the rechecks' trials included, within 8 %
    assert cluster.throughput(climb.incumbent, load) >= 0.94 * cluster.throughput(best, load)
    assert late >= 0.92 * cluster.throughput(best, load)


def test_arms_within_noise_of_each_other_do_not_flap():
    flat = SimulatedCluster(verify_fixed_ms=20.0, verify_per_position_ms=0.0, draft_fixed_ms=0.0,
                            draft_per_row_ms=0.0, keep=0.0, coordination_ms=0.0, seed=3)
    # keep 0: every arm yields one token a round at the same cost: all equal
    control = controller()
    drive(control, flat, 8, 300.0)
    climb = control.levels[level_of(8)]
    assert climb.incumbent == Arm(0)         # a tie with the target alone goes to it
    changes, climbs = climb.changes, climb.climbs
    drive(control, flat, 8, 300.0)
    assert climb.climbs - climbs >= 4        # rechecked now and then...
    assert climb.changes == changes          # ...without moving between equals


def test_a_load_change_mid_run_moves_the_choice_and_coming_back_remembers_it():
    cluster = compute_bound(seed=11)
    control = controller()
    drive(control, cluster, 1, 60.0)
    light = control.levels[level_of(1)].incumbent
    assert light.k >= 1
    drive(control, cluster, 16, 60.0)
    assert control.levels[level_of(16)].incumbent.k == 0
    back = drive(control, cluster, 1, 20.0)
    assert back[len(back) // 5:].count(light) >= 0.85 * len(back[len(back) // 5:])   # its own best again


def test_a_level_met_first_starts_a_step_below_the_lighter_level_known():
    control = controller()
    drive(control, memory_bound(seed=2), 1, 60.0)
    light = control.levels[level_of(1)]
    assert light.incumbent.k >= 6
    below = light._step(light.incumbent, -1)
    assert control.climb(level_of(3)).incumbent == below
    assert control.climb(level_of(2)).incumbent == below       # level 3-5 measured nothing: from level 1 still


def test_a_change_of_acceptance_at_a_settled_level_starts_a_new_climb():
    cluster = memory_bound(seed=4)
    control = controller()
    drive(control, cluster, 1, 60.0)
    assert control.levels[level_of(1)].incumbent.k >= 6
    cluster.keep = 0.02                      # the traffic changed: drafts are no longer kept
    drive(control, cluster, 1, 60.0)
    assert control.levels[level_of(1)].incumbent.k <= 1


def test_overlap_is_one_more_neighbour_when_auto():
    # lookaheads hide most of the draft time: with overlap auto the climb takes it
    cluster = SimulatedCluster(verify_fixed_ms=8.0, verify_per_position_ms=1.0, draft_fixed_ms=4.0,
                               draft_per_row_ms=0.0, keep=0.8, overlap_saves=0.8, seed=6)
    control = controller(overlap="auto")
    arms = drive(control, cluster, 1, 60.0)
    assert control.levels[level_of(1)].incumbent.overlap
    assert any(not arm.overlap for arm in arms) and any(arm.overlap for arm in arms)
    fixed = controller(overlap=False)
    assert not any(arm.overlap for arm in drive(fixed, cluster, 1, 30.0))


def test_a_pause_restarts_the_duel_under_way():
    """Windows measured before the level's load went elsewhere are not compared with windows after."""
    control = controller()
    cluster = compute_bound(seed=8)
    drive(control, cluster, 1, 1.5)          # the incumbent's first window, the challenger's begun
    climb = control.levels[level_of(1)]
    assert climb.running != climb.incumbent
    challenger = climb.running
    cluster.clock += 30.0                    # the level sees nothing for a while
    drive(control, cluster, 1, 0.1)
    assert climb.running == climb.incumbent and climb._queue[0][0] == challenger


def test_the_k_a_round_gets_is_bounded_whatever_the_state():
    control = KController(min_k=1, max_k=5, start_k=3)
    level = control.note_load(1)
    climb = control.climb(level)
    climb.incumbent = Arm(40, True)           # a state out of bounds (and an overlap not allowed)
    climb._duel = None
    assert control.choose(level, cap=64) == Arm(5, False)
    assert control.choose(level, cap=2) == Arm(2, False)
    climb.incumbent = Arm(0)
    assert control.choose(level, cap=64) == Arm(1, False)
    assert control.choose(level, cap=0).k == 0    # the last token: no room for a draft


def test_load_levels_keep_powers_of_two_inside():
    assert [level_name(level_of(n)) for n in (1, 2, 3, 5, 6, 7, 8, 11, 12, 16, 23, 24, 64)] == [
        "1", "2", "3-5", "3-5", "6-11", "6-11", "6-11", "6-11", "12-23", "12-23", "12-23", "24+", "24+"]


def test_a_measure_is_tokens_per_second_across_sequences_with_its_error():
    window = Measure()
    for _ in range(100):
        window.add(3, 10.0, 8)        # 3 tokens per 10 ms per sequence, 8 sequences
    assert window.tokens_per_s() == pytest.approx(2400.0)
    assert window.goodput(2.0) == pytest.approx(1600.0)    # E(k) of 2 tokens a round instead
    assert window.relative_error_sq() == pytest.approx(0.0, abs=1e-12)
    noisy = Measure()
    for i in range(100):
        noisy.add(1, 5.0 + 10 * (i % 2), 1)
    assert noisy.relative_error_sq() == pytest.approx((5.025 / 10) ** 2 / 100, rel=0.01)   # (sd / mean)^2 / n


def test_climbs_move_only_on_adaptive_rounds_and_every_round_fills_the_table():
    control = controller()
    cluster = compute_bound(seed=1)
    level = control.note_load(1)
    for _ in range(500):
        arm = Arm(2)
        tokens, ms = cluster.round(arm, 1)
        control.observe(level, arm, 2, tokens - 1, ms, 0.0, 1, adaptive=False, measured=True, now=cluster.clock)
    climb = control.climb(level)
    assert climb.rounds == 0 and climb.incumbent == Arm(4)
    assert climb.table[Arm(2)].rounds > 300
    control.observe(level, Arm(2), 2, 1, 1.0, 0.0, 1, adaptive=True, measured=False, now=0.0)   # a first round
    assert climb.rounds == 0
