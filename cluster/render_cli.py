"""`specserve render`: write what other tools deploy, from cluster.yaml.

    specserve render serve-config [--config cluster.yaml] [--models-dir DIR | --models-uri URI] [--out FILE]
    specserve render k8s [--config k8s/cluster.yaml] [--out-dir k8s]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.config import DEFAULT_CONFIG_FILE, ConfigError


def add_parser(commands) -> None:
    render = commands.add_parser("render", help="render a Serve config or KubeRay manifests from a cluster config",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = render.add_subparsers(dest="render_target", required=True)
    serve = targets.add_parser("serve-config", help="a Ray Serve config file for `serve deploy`")
    serve.add_argument("--config", type=Path, default=Path(DEFAULT_CONFIG_FILE))
    where = serve.add_mutually_exclusive_group()
    where.add_argument("--models-dir", help="the folder holding the model folders on every node")
    where.add_argument("--models-uri", help="a zip of the model folders that Ray fetches onto each node "
                                            "(s3://, gs://, https://)")
    serve.add_argument("--out", type=Path, help="file to write (default: standard output)")
    serve.set_defaults(handler=_serve_config)
    k8s = targets.add_parser("k8s", help="k8s/rayservice.yaml and k8s/rayjob.yaml")
    k8s.add_argument("--config", type=Path, default=Path("k8s") / "cluster.yaml")
    k8s.add_argument("--out-dir", type=Path, default=Path("k8s"))
    k8s.set_defaults(handler=_k8s)


def _serve_config(args: argparse.Namespace) -> int:
    from cluster.render import render_serve_config

    text = _or_report(lambda: render_serve_config(args.config, args.models_dir, args.models_uri))
    if text is None:
        return 1
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def _k8s(args: argparse.Namespace) -> int:
    from cluster.kuberay import render_k8s

    files = _or_report(lambda: render_k8s(args.config))
    if files is None:
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out_dir / name).write_text(text)
        print(f"wrote {args.out_dir / name}")
    return 0


def _or_report(render):
    try:
        return render()
    except ConfigError as exc:
        print(f"{exc.source}: {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return None
    except OSError as exc:
        print(f"cannot read the config: {exc}", file=sys.stderr)
        return None
