"""The application builder that a Serve config file names (`import_path`), for `serve deploy`
and KubeRay's RayService: its `args` hold the cluster config itself (cluster.yaml's content,
model paths as the cluster's nodes see them), so the running application is built from the
same file, by the same `build_app`, as `specserve up` builds it."""

from __future__ import annotations

from pathlib import Path

from ray.serve import Application

from cluster.app import build_app
from cluster.config import parse_config

IMPORT_PATH = "cluster.serve_app:build"


def build(args: dict) -> Application:
    """args: {"cluster": <cluster.yaml as a mapping>}; relative paths resolve against the
    working directory of the process that builds the application."""
    return build_app(parse_config(args["cluster"], base=Path.cwd(), source="serve config args.cluster"))
