"""The `specserve` command: `up` starts the cluster, `config check` validates cluster.yaml,
`bench` measures it against its baselines, `status` summarises a running one, `render`
writes a Serve config and KubeRay manifests from it."""

from __future__ import annotations

import argparse
import sys

from cluster.bench.run import add_parser as add_bench_parser
from cluster.config import DEFAULT_CONFIG_FILE
from cluster.launch import load_or_report, shutdown, start, wait_until_interrupted
from cluster.render_cli import add_parser as add_render_parser
from cluster.status import add_parser as add_status_parser


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

    add_bench_parser(commands)
    add_status_parser(commands)
    add_render_parser(commands)
    return parser


def _config_check(args: argparse.Namespace) -> int:
    config = load_or_report(args.path)
    if config is None:
        return 1
    draft = config.models.draft.path if config.models.draft is not None else "none: prompt lookup only"
    print(f"{args.path}: ok (target {config.models.target.path}, draft {draft})")
    return 0


def _up(args: argparse.Namespace) -> int:
    config = load_or_report(args.config)
    if config is None:
        return 1
    server = config.server.model_copy(update={
        k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    config = config.model_copy(update={"server": server})

    from cluster.app import ensure_gguf_files, ensure_placeholder_models

    ensure_placeholder_models(config)
    ensure_gguf_files(config)
    try:
        start(config)
        wait_until_interrupted()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
