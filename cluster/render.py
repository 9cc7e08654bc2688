"""From cluster.yaml to what other tools deploy: a Ray Serve config file for `serve deploy`
(and the `serveConfigV2` of a KubeRay RayService). Nothing here restates a setting: every
deployment option is read off the application that `cluster/app.py` builds, and the
application itself is built by `cluster/serve_app.py` from the cluster config carried in
the file's `args`.

Models: the config's model paths are the paths on the machine that renders. For a cluster,
`models_dir` replaces the folder holding each model (the models must be there on every node
that runs a replica: baked into the image, or on a shared volume), or `models_uri` names an
archive that Ray fetches onto each node (the application's `runtime_env.working_dir`: an
s3://, gs:// or https:// zip of a folder with the models), with the model paths kept
relative to it. Nothing comes from a model hub.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ClusterConfig, parse_config

HEADER = "# Rendered from {source} by `specserve render {what}`; edit that file and render again.\n"


def cluster_data(config: ClusterConfig, raw: dict, models_dir: str | None = None,
                 models_uri: str | None = None) -> dict:
    """The cluster config as the application's args: the raw YAML mapping with the model
    paths the cluster's nodes will see (absolute, under models_dir, or relative to models_uri)."""
    data = copy.deepcopy(raw)
    for role, spec in config.models.specs().items():
        for key in ("path", "tokenizer"):
            resolved = getattr(spec, key)
            if resolved is not None:
                data["models"][role][key] = (str(Path(models_dir) / resolved.name) if models_dir else
                                             resolved.name if models_uri else str(resolved))
    return data


def serve_config(config: ClusterConfig, raw: dict, models_dir: str | None = None,
                 models_uri: str | None = None) -> dict:
    """A Ray Serve config (ServeDeploySchema) for this cluster."""
    from ray.serve._private.build_app import build_app as build_serve_app
    from ray.serve.deployment import deployment_to_schema
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import APP_NAME, build_app, controller_options
    from cluster.serve_app import IMPORT_PATH

    built = build_serve_app(build_app(config), name=APP_NAME)
    application = {
        "name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
        "args": {"cluster": cluster_data(config, raw, models_dir, models_uri)},
        "deployments": [_plain(deployment_to_schema(d).model_dump(exclude_unset=True)) for d in built.deployments],
    }
    if models_uri:
        application["runtime_env"] = {"working_dir": models_uri}
    document = {"proxy_location": "EveryNode",
                "http_options": {"host": config.server.host, "port": config.server.port},
                "applications": [application]}
    if controller_options(config.server):
        document["controller_options"] = controller_options(config.server)
    ServeDeploySchema.model_validate(document)
    return document


def _plain(value: Any) -> Any:
    """Deployment options as YAML can hold them: the autoscaling policy by its import path."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items() if key != "_serialized_policy_def"}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, type):
        return f"{value.__module__}:{value.__qualname__}"
    return value


def load_raw(path: Path) -> dict:
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def render_serve_config(config_path: Path, models_dir: str | None, models_uri: str | None) -> str:
    raw = load_raw(config_path)
    config = parse_config(raw, base=Path(config_path).resolve().parent, source=str(config_path))
    document = serve_config(config, raw, models_dir, models_uri)
    return HEADER.format(source=config_path, what="serve-config") + yaml.safe_dump(document, sort_keys=False)
