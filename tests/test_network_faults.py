"""specserve across separate hosts, with real network faults between them: a head host (the
router), a small-GPU-like host (the draft pool) and a large one (the target pool), each a
network namespace with its own address and a Ray node declaring its kind. The draft host's
link is slowed (a token bucket on both ends), restored, then cut, then brought back. Expected: late
drafts are given up and rounds go on without them, greedy output stays exactly the target's
throughout, and after the heal the draft pool drafts again.

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

from tests.netns_hosts import ENV, Host, Hosts, can_make_namespaces, cut_link, heal_link, normal_link, slow_link, start_ray
from tests.network_faults_driver import MAX_TOKENS

HEAD = Host("ssfault-head", "10.213.77.2", {"router_node": 2})
DRAFT = Host("ssfault-draft", "10.213.77.3", {"small_gpu": 2})
TARGET = Host("ssfault-target", "10.213.77.4", {"large_gpu": 2})
DRIVER = Path(__file__).with_name("network_faults_driver.py")
SLOW_RATE = "8kbit"            # a draft call's reply takes longer than the driver's draft budget
DEPLOY_TIMEOUT_S = 300
PHASE_TIMEOUT_S = 180


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


@pytest.fixture
def hosts():
    why = can_make_namespaces()
    if why is not None:
        pytest.skip(f"no separate hosts on this machine: {why}")
    with Hosts([HEAD, DRAFT, TARGET]) as made:
        start_ray(HEAD, [DRAFT, TARGET])
        yield made


def test_a_slow_then_cut_draft_link_keeps_output_exact_and_speculation_returns_after_the_heal(
        hosts, zoo, greedy_reference, tmp_path):
    faults = {"clean": lambda: None,
              "slow": lambda: slow_link(DRAFT, SLOW_RATE),
              "restored": lambda: normal_link(DRAFT),
              "partition": lambda: cut_link(DRAFT),
              "healed": lambda: heal_link(DRAFT)}
    driver = Driver(zoo.target, zoo.drafts["perturbed"], tmp_path / "driver.log")
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
    print(json.dumps({"placement": placement, "phases": phases}, indent=1))   # the table in docs/ROBUSTNESS.md
    assert placement == {"router": ["router_node"], "draft": ["small_gpu"], "target": ["large_gpu"]}
    for phase in phases.values():
        for result in phase["results"]:
            assert result["status"] == 200, (phase["phase"], result)
            assert result["token_ids"] == greedy_reference(result["prompt"], MAX_TOKENS), (phase["phase"], result)
    clean, slow, restored, cut, healed = (phases[name]["results"] for name in faults)
    assert all(r["pool_drafted"] > 0 and r["fallback_rounds"] == 0 for r in clean)
    assert sum(r["fallback_rounds"] for r in slow) > 0           # late drafts were given up
    assert restored[-1]["pool_drafted"] > 0                      # the pool drafted again before the cut
    assert all(r["pool_drafted"] == 0 and r["fallback_rounds"] > 0 for r in cut)
    assert healed[-1]["pool_drafted"] > 0                        # and again after the heal
