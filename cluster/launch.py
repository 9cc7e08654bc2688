"""Starting and stopping a specserve cluster from this process: `specserve up` and
`specserve bench` (which starts the cluster it measures) both use this."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request

from cluster.config import ClusterConfig, ConfigError, load_config
from cluster.ports import holder


def load_or_report(path: str) -> ClusterConfig | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"{exc.source}: {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None


def start(config: ClusterConfig) -> None:
    """`specserve up`: Ray here (or at RAY_ADDRESS), then the application on it."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        _check_ports_free(config)
    print(f"joining the Ray cluster at {address}" if address else "starting Ray locally", flush=True)
    if not address:   # replicas report their queue depth to the autoscaler every 2 s, not 10
        os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "2")
    # "local": a new Ray here, even where `ray start` left a cluster address behind
    ray.init(address=address or "local", logging_level="WARNING", log_to_driver=False)
    _stop_on_sigterm()  # after ray.init, which installs a SIGTERM handler of its own
    url = deploy(config)
    print(f"specserve is up: {url}/v1  (model id: {config.server.model_name}); Ctrl-C stops it",
          flush=True)


# Ports a local start binds besides server.port: with server.ingress haproxy, Ray's HAProxy
# serves its stats and Prometheus metrics on these (RAY_SERVE_HAPROXY_STATS_PORT and
# RAY_SERVE_HAPROXY_METRICS_PORT, Ray 2.60's defaults).
def _haproxy_ports() -> list[int]:
    return [int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404")),
            int(os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", "9101"))]


def _check_ports_free(config: ClusterConfig) -> None:
    """A local start whose ports are taken would fail deep in Serve, after Ray started (a
    HAProxy left by a cluster that was killed rather than stopped keeps them): say so now,
    naming what holds them. Raises SystemExit."""
    ports = [config.server.port] + (_haproxy_ports() if config.server.ingress == "haproxy" else [])
    taken = {port: held for port in ports if (held := holder(port)) is not None}
    if taken:
        lines = [f"  port {port}: {what}" for port, what in taken.items()]
        raise SystemExit("cannot start: these ports are taken\n" + "\n".join(lines) + "\n"
                         "stop what holds them (a HAProxy left by an earlier cluster that was killed: kill its "
                         "pid) or give specserve up another --port")


def deploy(config: ClusterConfig) -> str:
    """Deploy the application on the connected Ray cluster and wait until it serves; its URL.
    Raises SystemExit with the reason when it cannot."""
    from ray import serve

    from cluster.app import APP_NAME, build_app, controller_options

    unhostable = _check_placement(config)
    compiled = [role for role, spec in config.models.specs().items() if spec.compile == "on"]
    if compiled:
        print(f"  compiling the {' and '.join(compiled)} forward at replica start (models.*.compile: on; "
              "a minute or more per model, less with inductor's cache warm)", flush=True)
    serve.start(http_options={"host": config.server.host, "port": config.server.port},
                controller_options=controller_options(config.server))
    # Not blocking: the app serves once the router and the target pool run; the draft pool is
    # optional (requests fall back to the target alone), so it must not hold up the start.
    serve._run(build_app(config), name=APP_NAME, route_prefix="/", _blocking=False)
    _wait_until_serving(APP_NAME)
    url = f"http://{_reachable_host(config.server.host)}:{config.server.port}"
    wait_for = set()
    if config.models.draft is not None:
        if "draft" in unhostable:
            print("  the draft pool is not running yet (no node can host a draft replica); requests are "
                  "served by the target alone until it is", flush=True)
        else:
            wait_for.add("draft")     # up only once it answers too (within _wait_until_ready's limit)
    _wait_until_ready(url, wait_for)
    return url


_REQUIRED_POOLS = ("router", "target")


def _check_placement(config: ClusterConfig) -> set[str]:
    """Say which pool the cluster's nodes cannot host in full, and which resource is missing;
    stop when the router or the target pool would have no replica at all. The pools no node
    can host a replica of."""
    from cluster.placement import alive_nodes, shortfalls

    unhostable = set()
    for shortfall in shortfalls(config, alive_nodes()):
        print(f"  {shortfall.message()}", flush=True)
        if shortfall.placed == 0 and shortfall.pool in _REQUIRED_POOLS:
            raise SystemExit(f"cannot serve: no node can host a {shortfall.pool} replica "
                             f"(pools.{shortfall.pool}.resources in the config, or the cluster's nodes)")
        if shortfall.placed == 0:
            unhostable.add(shortfall.pool)
    return unhostable


def _wait_until_serving(app_name: str) -> None:
    """Print each deployment's state whenever it changes, until the router and the target
    pool have a running replica each (the draft pool, optional, is waited for by /ready)."""
    from ray import serve

    last = None
    while True:
        app = serve.status().applications.get(app_name)
        deployments = app.deployments if app is not None else {}
        line = ", ".join(f"{name}: {d.status.value} {d.replica_states.get('RUNNING', 0)}/"
                         f"{sum(d.replica_states.values())}" for name, d in sorted(deployments.items()))
        if line and line != last:
            print(f"  loading models ... {line}", flush=True)
            last = line
        if app is not None and app.status.value == "DEPLOY_FAILED":
            raise SystemExit(f"deployment failed: {app.message}")
        if all(name in deployments and deployments[name].replica_states.get("RUNNING", 0) > 0
               for name in _REQUIRED_POOLS):
            break
        time.sleep(1.0)


def _reachable_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_until_ready(url: str, optional: set[str], timeout_s: float = 120.0) -> None:
    """Until the router's /ready says the target pool answers (router/readiness.py), and the
    pools in `optional` too, within timeout_s for those (after it, up without them)."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
                pools = json.loads(response.read()).get("pools", {})
                waiting = sorted(pool for pool in optional if not pools.get(pool))
                if not waiting:
                    return
        except OSError:        # 503 (the target pool still loading, HTTPError is an OSError) or no answer yet
            waiting = None
        if time.monotonic() > deadline:
            if waiting:
                print(f"  the {', '.join(waiting)} pool does not answer yet; requests are served without it until "
                      f"it does", flush=True)
                return
            raise SystemExit(f"{url}/ready did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.5)


def _stop_on_sigterm() -> None:
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def wait_until_interrupted() -> None:
    while True:
        time.sleep(3600)


def shutdown() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        print("shutting down", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
