"""Run by tests/test_multinode.py in a process of its own (one Ray cluster per process): a
multi-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster), a head and two
nodes of different kinds, serving the test models; prints a JSON report of where every
replica and shard ran, a greedy completion, and what `specserve up` said when the cluster
was too small.

    python tests/multinode_cluster.py TARGET_DIR DRAFT_DIR CONFIG_DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve
from ray.cluster_utils import Cluster

from cluster.app import build_app, controller_options
from cluster.config import ServerConfig, parse_config
from cluster.ports import free_port

SPECSERVE = Path(sys.executable).parent / "specserve"
SHARD = {"num_cpus": 0.1, "custom": {"large_gpu": 1}}
DRAFT = {"num_cpus": 0.1, "custom": {"small_gpu": 1}}


def config_data(target: str, draft: str, target_replicas: int = 1, tp_size: int = 2) -> dict:
    return {"models": {"target": {"path": target}, "draft": {"path": draft}},
            "pools": {"router": {"resources": {"num_cpus": 0.1}},
                      "draft": {"replicas": 2, "resources": DRAFT},
                      "target": {"replicas": target_replicas, "tp_size": tp_size, "resources": SHARD}},
            "limits": {"max_tokens": 64, "default_max_tokens": 16, "context_length": 512}}


def node_kinds() -> dict[str, str]:
    kinds = {}
    for node in ray.nodes():
        resources = node["Resources"]
        kinds[node["NodeID"]] = ("large" if "large_gpu" in resources else
                                 "small" if "small_gpu" in resources else "head")
    return kinds


def replica_states(app: str, deployment: str, replicas: int) -> list[dict]:
    """describe() of each replica: calls sent together spread over the replicas."""
    handle = serve.get_deployment_handle(deployment, app_name=app)
    states: dict[int, dict] = {}
    for _ in range(20):
        for state in [r.result() for r in [handle.describe.remote() for _ in range(16)]]:
            states[state["pid"]] = state
        if len(states) == replicas:
            break
    return list(states.values())


def specserve_up(config: dict, address: str, folder: Path, name: str, wait_s: float = 240) -> dict:
    """`specserve up` against the cluster: its output until it is up or exits, then SIGTERM;
    again with another port if a Ray process took the free one first."""
    for _ in range(3):
        outcome = _specserve_up_once(config, address, folder, name, wait_s)
        if not any("Failed to bind to address" in line for line in outcome["output"]):
            break
    return outcome


def _specserve_up_once(config: dict, address: str, folder: Path, name: str, wait_s: float) -> dict:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "server": {"port": free_port()}}))
    env = {**os.environ, "RAY_ADDRESS": address}
    process = subprocess.Popen([str(SPECSERVE), "up", "--config", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines, deadline = [], time.monotonic() + wait_s
    for line in process.stdout:
        lines.append(line.rstrip())
        if "specserve is up" in line or time.monotonic() > deadline:
            break
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        code = None
    lines += [line.rstrip() for line in process.stdout]
    return {"exit_code": code, "output": lines}


def main(target: str, draft: str, folder: Path) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "gcs_server_port": free_port(),
                                                            "dashboard_port": free_port()})
    cluster.add_node(num_cpus=1, resources={"small_gpu": 2})
    cluster.add_node(num_cpus=1, resources={"large_gpu": 2})
    cluster.wait_for_nodes()
    report = {}
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        kinds = node_kinds()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    controller_options=controller_options(ServerConfig()))
        serve.run(build_app(parse_config(config_data(target, draft), base=Path.cwd())),
                  name="multi", route_prefix="/multi")
        report["drafts"] = [kinds[s["node_id"]] for s in replica_states("multi", "draft", 2)]
        report["target_shards"] = [[kinds[shard["node_id"]] for shard in s["shards"]]
                                   for s in replica_states("multi", "target", 1)]
        body = {"model": "specserve", "prompt": "import os\n", "max_tokens": 16, "temperature": 0,
                "return_token_ids": True, "speculation": {"k": 3}}
        out = httpx.post(f"http://127.0.0.1:{port}/multi/v1/completions", json=body, timeout=120).json()
        report["completion"] = {"token_ids": out["choices"][0]["token_ids"], "speculation": out["speculation"]}
        serve.shutdown()
        report["up_two_target_replicas"] = specserve_up(config_data(target, draft, target_replicas=2),
                                                        cluster.address, folder, "two-replicas")
        report["up_four_shards"] = specserve_up(config_data(target, draft, tp_size=4),
                                                cluster.address, folder, "four-shards", wait_s=120)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))), flush=True)
