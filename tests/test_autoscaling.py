"""Each pool scales by its own queue depth: under a bounded load the target pool (which
counts the sequences it serves, not the gathered calls it receives) grows above its minimum,
and returns to it once the load is gone; every request meanwhile completes exactly."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve

from cluster.autoscaling import SequencesPerReplica
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import complete

CLIENTS = 8
LOAD_S = 25
# A new target replica measures its cost profile before it runs: on a slow or busy machine its
# start takes longer than the load above, so the load lasts until one is running, up to this.
LONGEST_LOAD_S = 90
MAX_TOKENS = 64


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


def replicas_running(app: str, deployment: str) -> int:
    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def test_the_busy_pool_scales_up_under_load_and_back_down(ray_serve, zoo, greedy_reference):
    scaling = {"min_replicas": 1, "max_replicas": 3, "target_queue_per_replica": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_s": 11}
    pools = {"target": {"autoscaling": scaling, "resources": {"num_cpus": 0.1}}}
    url = deploy(ray_serve, "scaling", cluster_config(zoo.target, zoo.drafts["perturbed"], pools=pools))
    stop, counts, results = threading.Event(), [], []

    def client(index: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[index % len(PROMPTS)]
            results.append((prompt, complete(url, prompt, max_tokens=MAX_TOKENS, speculation={"k": 2})))

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client, i) for i in range(CLIENTS)]
            started = time.monotonic()
            while time.monotonic() < started + LONGEST_LOAD_S:
                counts.append(replicas_running("scaling", "target"))
                if time.monotonic() > started + LOAD_S and max(counts) > 1:
                    break
                time.sleep(0.5)
            stop.set()
            for future in futures:
                future.result()
        assert max(counts) > 1, counts
        deadline = time.monotonic() + 90
        while replicas_running("scaling", "target") > 1 and time.monotonic() < deadline:
            time.sleep(1)
        assert replicas_running("scaling", "target") == 1
        assert len(results) >= CLIENTS
        for prompt, result in results:
            assert result["choices"][0]["token_ids"] == greedy_reference(prompt, MAX_TOKENS)
        after = complete(url, PROMPTS[0], max_tokens=MAX_TOKENS, speculation={"k": 2})
        assert after["choices"][0]["token_ids"] == greedy_reference(PROMPTS[0], MAX_TOKENS)
    finally:
        serve.delete("scaling")
