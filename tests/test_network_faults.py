"""specserve across separate hosts, with real network faults between them: a head host (the
router), a small-GPU-like host (the draft pool) and a large one (the target pool), each a
network namespace with its own address and a Ray node declaring its kind. The draft host's
link is slowed (a token bucket on both ends), restored, then cut, then brought back. Expected: late
drafts are given up and rounds go on without them, greedy output stays exactly the target's
throughout, and after the heal the draft pool drafts again. A second run cuts the draft host
off until Ray declares its node dead, then brings the host back as a new node.

Needs root (CI here runs as root); without the privileges to make namespaces it skips and says
why. Bounded in time; every namespace, link and process it made is removed when it ends.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.netns_hosts import (ENV, Host, Hosts, can_make_namespaces, cut_link, heal_link, kill_processes, normal_link,
                               slow_link, start_ray, start_worker)
from tests.network_faults_driver import MAX_TOKENS

HEAD = Host("ssfault-head", "10.213.77.2", {"router_node": 2})
DRAFT = Host("ssfault-draft", "10.213.77.3", {"small_gpu": 2})
TARGET = Host("ssfault-target", "10.213.77.4", {"large_gpu": 2})
DRIVER = Path(__file__).with_name("network_faults_driver.py")
SLOW_RATE = "8kbit"            # a draft call's reply takes longer than the driver's draft budget
DEPLOY_TIMEOUT_S = 300
PHASE_TIMEOUT_S = 180
# A head whose GCS gives a silent node up within seconds rather than Ray's default 15-60 s.
QUICK_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                       "RAY_health_check_failure_threshold": "5"}


class Driver:
    """tests/network_faults_driver.py in the head host; one JSON line per phase asked for."""

    def __init__(self, target: Path, draft: Path, log: Path):
        env = {**ENV, "PYTHONPATH": str(Path.cwd())}
        self._log = log.open("w")
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", HEAD.name, sys.executable, str(DRIVER), str(target), str(draft), HEAD.address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def next(self, timeout_s: float) -> dict:
        try:
            report = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"the driver said nothing for {timeout_s} s") from None
        assert report is not None, "the driver exited early"
        return report

    def ask(self, phase: str) -> dict:
        self.process.stdin.write(phase + "\n")
        self.process.stdin.flush()
        return self.next(PHASE_TIMEOUT_S)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._log.close()


def made_hosts(head_env: dict | None = None):
    why = can_make_namespaces()
    if why is not None:
        pytest.skip(f"no separate hosts on this machine: {why}")
    with Hosts([HEAD, DRAFT, TARGET]) as made:
        start_ray(HEAD, [DRAFT, TARGET], head_env)
        yield made


@pytest.fixture
def hosts():
    yield from made_hosts()


@pytest.fixture
def hosts_with_quick_health_checks():
    yield from made_hosts(QUICK_HEALTH_CHECKS)


def run_phases(faults: dict, zoo, log: Path) -> tuple[list, dict]:
    """The driver deployed, then each fault made and its phase's requests sent."""
    driver = Driver(zoo.target, zoo.drafts["perturbed"], log)
    try:
        placement = driver.next(DEPLOY_TIMEOUT_S)["placement"]
        phases = {}
        for name, fault in faults.items():
            fault()
            phases[name] = driver.ask(name)
        driver.process.stdin.write("stop\n")
        driver.process.stdin.flush()
    finally:
        driver.close()
    print(json.dumps({"placement": placement, "phases": phases}, indent=1))   # the tables in docs/ROBUSTNESS.md
    return placement, phases


def assert_exact(phases: dict, greedy_reference) -> None:
    for phase in phases.values():
        for result in phase["results"]:
            assert result["status"] == 200, (phase["phase"], result)
            assert result["token_ids"] == greedy_reference(result["prompt"], MAX_TOKENS), (phase["phase"], result)


def test_a_slow_then_cut_draft_link_keeps_output_exact_and_speculation_returns_after_the_heal(
        hosts, zoo, greedy_reference, tmp_path):
    faults = {"clean": lambda: None,
              "slow": lambda: slow_link(DRAFT, SLOW_RATE),
              "restored": lambda: normal_link(DRAFT),
              "partition": lambda: cut_link(DRAFT),
              "healed": lambda: heal_link(DRAFT)}
    placement, phases = run_phases(faults, zoo, tmp_path / "driver.log")
    assert placement == {"router": ["router_node"], "draft": ["small_gpu"], "target": ["large_gpu"]}
    assert_exact(phases, greedy_reference)
    clean, slow, restored, cut, healed = (phases[name]["results"] for name in faults)
    assert all(r["pool_drafted"] > 0 and r["fallback_rounds"] == 0 for r in clean)
    assert sum(r["fallback_rounds"] for r in slow) > 0           # late drafts were given up
    assert restored[-1]["pool_drafted"] > 0                      # the pool drafted again before the cut
    assert all(r["pool_drafted"] == 0 and r["fallback_rounds"] > 0 for r in cut)
    assert healed[-1]["pool_drafted"] > 0                        # and again after the heal


def test_a_draft_node_cut_off_until_ray_declares_it_dead_then_replaced_brings_speculation_back(
        hosts_with_quick_health_checks, zoo, greedy_reference, tmp_path):
    """A partition long enough for Ray to give the draft node up: its replica is dead to
    Serve, which cannot place another (no other node has small_gpu), and every round goes on
    without the pool. Then the machine comes back as a new node (its old processes gone, as
    after a reboot; a node Ray declared dead never rejoins as itself) and Serve starts a draft
    replica on it."""
    def replace_draft_node():
        kill_processes(DRAFT)
        heal_link(DRAFT)
        start_worker(HEAD, DRAFT)

    faults = {"clean": lambda: None, "dead": lambda: cut_link(DRAFT), "rejoined": replace_draft_node}
    placement, phases = run_phases(faults, zoo, tmp_path / "driver.log")
    assert placement["draft"] == ["small_gpu"]
    assert_exact(phases, greedy_reference)
    clean, dead, rejoined = (phases[name] for name in faults)
    assert all(r["pool_drafted"] > 0 for r in clean["results"])
    assert not dead["draft_node_alive"], "Ray did not declare the cut-off node dead in time"
    assert all(r["pool_drafted"] == 0 and r["fallback_rounds"] > 0 for r in dead["results"])
    assert rejoined["draft_node_alive"] and rejoined["results"][-1]["pool_drafted"] > 0
