"""`specserve status`: a one-screen summary of a running specserve application: each pool's
state, its replicas and the nodes they run on, queues, batching and caches, and the routers'
acceptance, adaptive k and tokens per second.

    specserve status [--app specserve]        (RAY_ADDRESS, or the local cluster)
"""

from __future__ import annotations

import argparse
import logging
import os
from collections import Counter

_CALLS_TO_FIND_REPLICAS = 16     # describe calls sent together spread over the replicas
_ROUNDS_TO_FIND_REPLICAS = 5


def add_parser(commands) -> None:
    status = commands.add_parser("status", help="summarise a running cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    status.add_argument("--app", default="specserve", help="Serve application name (default: %(default)s)")
    status.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    # Serve's driver logger writes INFO lines (handles made, replicas found) to the terminal:
    # the summary is all this command prints, its problems on stderr.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        app = serve.status().applications.get(args.app)
        if app is None:
            print(f"no Serve application named {args.app!r} on this cluster")
            return 1
        nodes = {node["NodeID"]: node.get("NodeManagerAddress", "?") for node in ray.nodes()}
        print(f"specserve application {args.app!r}: {app.status.value}")
        for name in ("router", "draft", "target"):
            deployment = app.deployments.get(name)
            if deployment is None:
                print(f"  {name:<7} missing")
                continue
            states = replica_states(args.app, name, deployment.replica_states.get("RUNNING", 0))
            print(_pool_line(name, deployment, states, nodes))
        routers = replica_states(args.app, "router", app.deployments["router"].replica_states.get("RUNNING", 0))
        print(_traffic_line(routers))
        for line in _adaptive_lines(routers):
            print(line)
    finally:
        ray.shutdown()
    return 0


def running_replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    found = status.deployments.get(deployment) if status is not None else None
    return found.replica_states.get("RUNNING", 0) if found is not None else 0


def replica_states(app: str, deployment: str, running: int) -> list[dict]:
    """describe() of each running replica, found by pid."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    found: dict[int, dict] = {}
    for _ in range(_ROUNDS_TO_FIND_REPLICAS if running else 0):
        responses = [handle.describe.remote() for _ in range(_CALLS_TO_FIND_REPLICAS)]
        for response in responses:
            try:
                state = response.result(timeout_s=10)
            except Exception:  # noqa: BLE001 - a replica that cannot answer is left out
                continue
            found[state["pid"]] = state
        if len(found) >= running:
            break
    return list(found.values())


def _pool_line(name: str, deployment, states: list[dict], nodes: dict[str, str]) -> str:
    running, total = deployment.replica_states.get("RUNNING", 0), sum(deployment.replica_states.values())
    where = Counter(nodes.get(state.get("node_id"), "?") for state in states if state.get("node_id"))
    placed = ", ".join(f"{node} x{count}" for node, count in where.items()) or "-"
    line = f"  {name:<7} {deployment.status.value:<10} replicas {running}/{total}  on {placed}"
    if name == "router":
        return line + "  requests: " + ", ".join(
            f"{key} {sum(s.get(key, 0) for s in states)}" for key in ("running", "queued", "refused"))
    tp = max((s.get("tp_size", 1) for s in states), default=1)
    sequences = sum(s.get("active_sequences", 0) for s in states)
    batches = [s["mean_batch"] for s in states if s.get("batches")]
    cached = sum(s.get("cached_tokens", 0) for s in states)
    evictions = sum(s.get("evictions", 0) for s in states)
    return (line + (f" (tp {tp})" if tp > 1 else "") + f"  sequences {sequences}, mean batch "
            f"{sum(batches) / len(batches) if batches else 0:.2f}, cached {cached} tokens, {evictions} evictions"
            + own_drafts_text(states))


def own_drafts_text(states: list[dict]) -> str:
    """The target engine's own drafts in lone windows (llama.cpp, replicas/engines/huggingface/
    engine.py), kept of sent over the pool's replicas; empty where none were sent."""
    counts = [s["engine_drafts"] for s in states if s.get("engine_drafts")]
    sent = sum(c["sent"] for c in counts)
    return f", own drafts kept {sum(c['kept'] for c in counts)} of {sent}" if sent else ""


def _traffic_line(routers: list[dict]) -> str:
    totals = [state.get("totals", {}) for state in routers]
    drafted, accepted = sum(t.get("drafted", 0) for t in totals), sum(t.get("accepted", 0) for t in totals)
    rate = sum(t.get("tokens_per_s_last_minute", 0.0) for t in totals)
    requests = sum(t.get("requests", 0) for t in totals)
    plans = [state.get("adaptive", {}).get("plan") or {} for state in routers]
    ks = ", ".join(str(plan.get("mean_k", "-")) for plan in plans)
    acceptance = f"{accepted / drafted:.3f}" if drafted else "-"
    return (f"  traffic  {requests} requests, {rate:.1f} tokens/s over the last minute, acceptance "
            f"{acceptance}, mean k planned {ks or '-'}")


def _adaptive_lines(routers: list[dict]) -> list[str]:
    """Per router: the goodput controller's plan, its k by method over recent rounds, and how
    well its cost model predicts."""
    lines = []
    for i, state in enumerate(routers):
        adaptive = state.get("adaptive", {})
        plan = adaptive.get("plan") or {}
        rounds = adaptive.get("round_ms", {})
        costs = adaptive.get("costs", {})
        lines.append(f"  adaptive router {i + 1}: {adaptive.get('in_flight', 0)} in flight: {plan.get('steps', '-')} "
                     f"steps a call, draft call {'yes' if plan.get('draft_call') else 'no'}, predicted "
                     f"{plan.get('tokens_per_s', '-')} tokens/s; round ms predicted {rounds.get('predicted')} "
                     f"measured {rounds.get('measured')}; model error {costs.get('round_mean_abs_log_error')}")
        for method, counts in adaptive.get("k_by_method", {}).items():
            total = sum(counts.values()) or 1
            shares = ", ".join(f"k={k} {count / total:.0%}" for k, count in counts.items())
            lines.append(f"    k of its {method or '-'} rounds: {shares}")
    return lines
