"""The `specserve` command: `up` starts the cluster, `config check` validates cluster.yaml,
`bench` measures it against its baselines."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import urllib.request

from cluster.config import DEFAULT_CONFIG_FILE, ClusterConfig, ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start Ray (or join RAY_ADDRESS) and serve cluster.yaml")
    up.add_argument("--config", default=DEFAULT_CONFIG_FILE, help="cluster config (default: %(default)s)")
    up.add_argument("--host", help="HTTP host (default: server.host of the config)")
    up.add_argument("--port", type=int, help="HTTP port (default: server.port of the config)")
    up.set_defaults(handler=_up)

    config = commands.add_parser("config", help="configuration tools")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate a cluster config, print every problem")
    check.add_argument("path", nargs="?", default=DEFAULT_CONFIG_FILE)
    check.set_defaults(handler=_config_check)

    from cluster.bench.run import add_parser as add_bench_parser

    add_bench_parser(commands)
    return parser


def _load_or_report(path: str) -> ClusterConfig | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"{exc.source}: {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None


def _config_check(args: argparse.Namespace) -> int:
    config = _load_or_report(args.path)
    if config is None:
        return 1
    print(f"{args.path}: ok (target {config.models.target.path}, draft {config.models.draft.path})")
    return 0


def _up(args: argparse.Namespace) -> int:
    config = _load_or_report(args.config)
    if config is None:
        return 1
    server = config.server.model_copy(update={
        k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    config = config.model_copy(update={"server": server})

    from cluster.app import ensure_placeholder_models

    ensure_placeholder_models(config)
    try:
        _start(config)
        _wait_until_interrupted()
    except KeyboardInterrupt:
        pass
    finally:
        _shutdown()
    return 0


def _start(config: ClusterConfig) -> None:
    import ray
    from ray import serve

    from cluster.app import APP_NAME, build_app

    address = os.environ.get("RAY_ADDRESS")
    print(f"joining the Ray cluster at {address}" if address else "starting Ray locally", flush=True)
    ray.init(address=address or None, logging_level="WARNING", log_to_driver=False)
    _stop_on_sigterm()  # after ray.init, which installs a SIGTERM handler of its own
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    # Not blocking: the app serves once the router and the target pool run; the draft pool is
    # optional (requests fall back to the target alone), so it must not hold up the start.
    serve._run(build_app(config), name=APP_NAME, route_prefix="/", _blocking=False)
    _wait_until_serving(APP_NAME)
    url = f"http://{_reachable_host(config.server.host)}:{config.server.port}"
    _wait_for_health(url)
    print(f"specserve is up: {url}/v1  (model id: {config.server.model_name}); Ctrl-C stops it",
          flush=True)


_REQUIRED_POOLS = ("router", "target")


def _wait_until_serving(app_name: str) -> None:
    """Print each deployment's state whenever it changes, until the router and the target
    pool are healthy; say so when the draft pool is not running by then."""
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
        if all(name in deployments and deployments[name].status.value == "HEALTHY" for name in _REQUIRED_POOLS):
            break
        time.sleep(1.0)
    draft = deployments.get("draft")
    if draft is not None and draft.status.value != "HEALTHY":
        print(f"  the draft pool is not running yet ({draft.message or draft.status.value}); requests are "
              f"served by the target alone until it is", flush=True)


def _reachable_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_for_health(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}/health did not answer within {timeout_s:.0f} s")
        time.sleep(0.5)


def _stop_on_sigterm() -> None:
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _wait_until_interrupted() -> None:
    while True:
        time.sleep(3600)


def _shutdown() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        print("shutting down", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
