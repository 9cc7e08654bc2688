"""Node kinds on a multi-node Ray cluster simulated on this machine (a head, a small-GPU node
and a large-GPU node, as custom resources): every draft replica runs on the small node, both
shards of the target replica together on the large node, output stays exact; asked for more
than the large node holds, `specserve up` names the pool and the missing resource."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("multinode_cluster.py")


@pytest.fixture(scope="module")
def report(zoo, tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(HELPER.parent.parent)
    configs = tmp_path_factory.mktemp("multinode")
    result = subprocess.run([sys.executable, str(HELPER), str(zoo.target), str(zoo.drafts["perturbed"]), str(configs)],
                            capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"exit {result.returncode}\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("REPORT "))


def test_drafts_run_on_small_nodes_and_shards_together_on_a_large_one(report):
    assert report["drafts"] == ["small", "small"]
    assert report["target_shards"] == [["large", "large"]]


def test_the_multi_node_cluster_serves_exact_greedy_output(report, greedy_reference):
    assert report["completion"]["token_ids"] == greedy_reference("import os\n", 16)
    assert report["completion"]["speculation"]["drafted_tokens"] > 0


def test_up_names_the_pool_and_resource_it_lacks_and_serves_what_fits(report):
    up = report["up_two_target_replicas"]
    text = "\n".join(up["output"])
    assert "pools.target: the cluster has room for 1 of 2 replicas" in text, text
    assert "missing: {large_gpu: 2} on one node" in text, text
    assert any("specserve is up" in line for line in up["output"]), text
    assert up["exit_code"] == 0, text


def test_up_stops_when_no_node_can_host_a_target_replica(report):
    up = report["up_four_shards"]
    text = "\n".join(up["output"])
    assert "pools.target: the cluster has room for 0 of 1 replicas" in text, text
    assert "cannot serve: no node can host a target replica" in text, text
    assert up["exit_code"] not in (0, None), text
