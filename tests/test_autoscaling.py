"""Each pool scales by its own queue depth: under a bounded load the target pool (which
counts the sequences it serves, not the gathered calls it receives) grows above its minimum,
and returns to it once the load is gone; every request meanwhile completes exactly."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve

from cluster.autoscaling import SequencesPerReplica
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import complete

CLIENTS = 8
MAX_TOKENS = 64
SCALING = {"min_replicas": 1, "max_replicas": 3, "target_queue_per_replica": 2,
           "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_s": 11}
# A replica started while the load takes both cores takes longer than one started at deploy:
# the deadline allows this many times the measured start.
START_UNDER_LOAD = 4


def metric_push_s() -> float:
    """How often replicas report their queue depth (every second in the test session's Ray,
    tests/conftest.py; Serve's default 10 s otherwise)."""
    return float(os.environ.get("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "10"))


class Context:
    """The part of Serve's AutoscalingContext the policy reads."""

    def __init__(self, reports: dict, target_num_replicas: int = 1):
        self.aggregated_metrics = {"active_sequences": reports} if reports is not None else None
        self.target_num_replicas = target_num_replicas


@pytest.mark.parametrize("reports, wanted", [
    ({"r1": 8.0, "r2": 3.0}, 6),     # 11 sequences at 2 per replica
    ({"r1": 0.0}, 0),                # idle: Serve's bounds keep min_replicas
    ({"r1": 2.0}, 1),
    ({}, 3),                         # nothing reported yet: keep the current target
])
def test_the_policy_asks_for_replicas_by_sequences_served(reports, wanted):
    assert SequencesPerReplica(target_queue_per_replica=2)(Context(reports, 3))[0] == wanted


def replica_states(app: str, deployment: str) -> dict[str, int]:
    return dict(serve.status().applications[app].deployments[deployment].replica_states)


class ReplicaLog:
    """The target pool's replica states over time, shown when the test fails."""

    def __init__(self, app: str):
        self.app, self.started, self.entries = app, time.monotonic(), []

    def running(self) -> int:
        states = replica_states(self.app, "target")
        self.entries.append((round(time.monotonic() - self.started, 1), states))
        return states.get("RUNNING", 0)

    def __str__(self) -> str:
        return "target replicas over time (s, states):\n" + "\n".join(f"  {t:6.1f} {states}" for t, states in self.entries)


def test_the_busy_pool_scales_up_under_load_and_back_down(ray_serve, zoo, greedy_reference):
    pools = {"target": {"autoscaling": SCALING, "resources": {"num_cpus": 0.1}}}
    began = time.monotonic()
    url = deploy(ray_serve, "scaling", cluster_config(zoo.target, zoo.drafts["perturbed"], pools=pools))
    start_s = time.monotonic() - began         # every replica's start, measured on this machine now
    # Up: the queue must fill the look-back window and outlast the upscale delay, a push must
    # report it, and the new replica must start under load.
    up_deadline_s = SCALING["look_back_s"] + SCALING["upscale_delay_s"] + 2 * metric_push_s() + START_UNDER_LOAD * start_s
    # Down: the same window and delay, then the replica scaled away drains (Serve's graceful
    # shutdown allows it 20 s).
    down_deadline_s = SCALING["look_back_s"] + SCALING["downscale_delay_s"] + 2 * metric_push_s() + 30
    stop, results, log = threading.Event(), [], ReplicaLog("scaling")

    def client(index: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[index % len(PROMPTS)]
            results.append((prompt, complete(url, prompt, max_tokens=MAX_TOKENS, speculation={"k": 2})))

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client, i) for i in range(CLIENTS)]
            load_began = time.monotonic()
            scaled_up = False
            while not scaled_up and time.monotonic() < load_began + up_deadline_s:
                scaled_up = log.running() > 1
                time.sleep(0.5)
            stop.set()
            for future in futures:
                future.result()
        assert scaled_up, f"not above 1 replica within {up_deadline_s:.0f} s of load (start {start_s:.1f} s)\n{log}"
        idle_began = time.monotonic()
        while log.running() > 1 and time.monotonic() < idle_began + down_deadline_s:
            time.sleep(1)
        assert log.running() == 1, f"not back to 1 replica within {down_deadline_s:.0f} s of idle\n{log}"
        assert len(results) >= CLIENTS
        for prompt, result in results:
            assert result["choices"][0]["token_ids"] == greedy_reference(prompt, MAX_TOKENS)
        after = complete(url, PROMPTS[0], max_tokens=MAX_TOKENS, speculation={"k": 2})
        assert after["choices"][0]["token_ids"] == greedy_reference(PROMPTS[0], MAX_TOKENS)
    finally:
        serve.delete("scaling")
