"""Run inside the head host by tests/test_network_faults.py: deploys specserve across the
hosts' Ray nodes (router on the head, drafts on the small-GPU-like node, the target on the
large one), prints where each pool's replicas run, then for every phase name read from stdin
sends the test's requests and prints what they got, one JSON line each; `stop` ends it.
Phases that wait for something (the draft pool drafting again, Ray declaring a node dead)
send the requests again until it happens or their time is up.

    ip netns exec ssfault-head python tests/network_faults_driver.py TARGET_DIR DRAFT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from cluster.app import build_app, controller_options
from cluster.config import ServerConfig, parse_config
from cluster.status import replica_states
from tests.netns_hosts import RAY_PORT

HEAD_ADDRESS = sys.argv[3] if len(sys.argv) > 3 else "10.213.77.2"
PORT = 8000                    # the head host's own port space
PROMPTS = ["import os\n", "def main(argv):\n    ", "class Stack:\n    def push(self, item):\n"]
MAX_TOKENS = 32
DRAFT_BUDGET_MS = 500.0
SPECULATION_BACK_WITHIN_S = 60
NODE_DEATH_WITHIN_S = 90       # with the test's health checks, Ray gives a silent node up in about 10 s
REJOIN_WITHIN_S = 150          # a new node registers, Serve starts a draft replica there, it loads


def config(target: str, draft: str) -> dict:
    return {"models": {"target": {"path": target}, "draft": {"path": draft}},
            "pools": {"router": {"resources": {"num_cpus": 0.1, "custom": {"router_node": 1}}},
                      "draft": {"resources": {"num_cpus": 0.1, "custom": {"small_gpu": 1}},
                                "call_timeout_ms": DRAFT_BUDGET_MS},
                      "target": {"resources": {"num_cpus": 0.1, "custom": {"large_gpu": 1}}}},
            "limits": {"max_tokens": 64, "default_max_tokens": 16, "context_length": 512}}


def node_kinds() -> dict[str, str]:
    kinds = {}
    for node in ray.nodes():
        resources = node["Resources"]
        kinds[node["NodeID"]] = next((kind for kind in ("router_node", "small_gpu", "large_gpu") if kind in resources), "?")
    return kinds


def placement() -> dict:
    kinds = node_kinds()
    return {pool: sorted(kinds.get(state["node_id"], "?") for state in replica_states("faults", pool, 1))
            for pool in ("router", "draft", "target")}


def one_request(prompt: str) -> dict:
    body = {"model": "specserve", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "speculation": {"method": "draft_model", "k": 4}}
    started = time.monotonic()
    response = httpx.post(f"http://127.0.0.1:{PORT}/faults/v1/completions", json=body, timeout=300)
    seconds = round(time.monotonic() - started, 2)
    if response.status_code != 200:
        return {"prompt": prompt, "status": response.status_code, "body": response.text[:300], "seconds": seconds}
    out = response.json()
    speculation = out["speculation"]
    return {"prompt": prompt, "status": 200, "token_ids": out["choices"][0]["token_ids"], "seconds": seconds,
            "pool_drafted": speculation["by_kind"]["draft_model"]["drafted_tokens"],
            "fallback_rounds": speculation["fallback_rounds"]}


RECOVERY_PHASES = {"restored": SPECULATION_BACK_WITHIN_S, "healed": SPECULATION_BACK_WITHIN_S,
                   "rejoined": REJOIN_WITHIN_S}


def wait_until_every_pool_answers(timeout_s: float = 120.0) -> None:
    """As `specserve up` does before it says it is up: until the router's /ready says the
    draft pool answers too. (Replicas healthy is not enough: a request sent before the router
    has seen the draft pool answer is served by the target alone, and the clean phase would
    measure that; it did once in CI.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"http://127.0.0.1:{PORT}/faults/ready", timeout=5)
            if response.status_code == 200 and response.json().get("pools", {}).get("draft"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the router did not see every pool answer within {timeout_s:.0f} s")


def draft_node_alive() -> bool:
    return any(node["Alive"] for node in ray.nodes() if "small_gpu" in node["Resources"])


def phase(name: str) -> dict:
    """The prompts once; after the link is back, again until the draft pool drafts or the
    time is up; in `dead`, again until Ray has declared the draft node dead."""
    started = time.monotonic()
    results = [one_request(prompt) for prompt in PROMPTS]

    def go_on() -> bool:
        if name == "dead":
            return draft_node_alive() and time.monotonic() < started + NODE_DEATH_WITHIN_S
        return (name in RECOVERY_PHASES and not any(r.get("pool_drafted") for r in results[-len(PROMPTS):])
                and time.monotonic() < started + RECOVERY_PHASES[name])

    while go_on():
        time.sleep(1)
        results += [one_request(prompt) for prompt in PROMPTS]
    return {"phase": name, "seconds": round(time.monotonic() - started, 1), "results": results,
            "draft_node_alive": draft_node_alive()}


def main(target: str, draft: str) -> None:
    ray.init(address=f"{HEAD_ADDRESS}:{RAY_PORT}", logging_level="WARNING", log_to_driver=False)
    # The ingress on the head host only: every node's HAProxy would share its config and socket
    # paths under /tmp, which these hosts, unlike real ones, have in common.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": PORT},
                controller_options=controller_options(ServerConfig()))
    serve.run(build_app(parse_config(config(target, draft), base=Path.cwd())), name="faults", route_prefix="/faults")
    wait_until_every_pool_answers()
    print(json.dumps({"placement": placement()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
        print(json.dumps(phase(line.strip())), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
