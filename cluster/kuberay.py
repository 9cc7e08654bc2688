"""KubeRay manifests rendered from a cluster config (`specserve render k8s`): a RayService
that serves and a RayJob that measures, on one RayCluster shape.

The cluster: a head that runs no work (`num-cpus: 0`; Serve's controller and a proxy), and
one worker group per pool, each node shaped to hold one replica of its pool: a router node
the router's resources, a draft node one draft replica's (e.g. `small_gpu: 1`, one GPU), a
target node one whole tensor-parallel replica (tp_size shards: `large_gpu: tp_size`,
tp_size GPUs), so that the STRICT_PACK placement group of a target replica always fits one
node. A node has whole GPUs (`ray start --num-gpus` takes no fraction, nor does
`nvidia.com/gpu`): a pool whose replicas reserve a fraction of one gets nodes of whole GPUs,
each holding as many replicas as fit (half a GPU each: two replicas a GPU). A group is named after the custom resource its pool asks for (`small_gpu` ->
`small-gpu`), or after the pool. Its min, max and initial node counts hold the pool's
autoscaling bounds (or its fixed replicas), and KubeRay's in-tree autoscaler adds and
removes nodes as Serve scales the pools. Serve listens on every node (port 8000; a Service
of `kubernetes.service_type` in front of it), Ray's metrics on 8080.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from cluster.config import ClusterConfig, KubernetesConfig, PodShape, Resources, parse_config
from cluster.render import HEADER, load_raw, serve_config

SERVE_PORT, METRICS_PORT, DASHBOARD_PORT, GCS_PORT, CLIENT_PORT = 8000, 8080, 8265, 6379, 10001
RAY_VERSION = "2.60.0"
_POOLS = ("router", "draft", "target")


def render_k8s(config_path: Path) -> dict[str, str]:
    """File name -> text of every manifest rendered from the config at config_path."""
    raw = load_raw(config_path)
    config = parse_config(raw, base=Path(config_path).resolve().parent, source=str(config_path))
    k8s = config.kubernetes
    serve = serve_config(config, raw, models_dir=k8s.models_dir)
    # The source as <folder>/<file>, however the path was spelt, so renders compare equal.
    path = Path(config_path).resolve()
    header = HEADER.format(source=f"{path.parent.name}/{path.name}", what="k8s")
    return {"rayservice.yaml": header + _dump(rayservice(config, serve)),
            "rayjob.yaml": header + _dump(rayjob(config))}


def rayservice(config: ClusterConfig, serve: dict) -> dict:
    k8s = config.kubernetes
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": k8s.name, "labels": _labels(k8s)},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve, sort_keys=False),
            "serveService": _serve_service(k8s),
            "rayClusterConfig": ray_cluster_spec(config, serve_probes=True),
        },
    }


def rayjob(config: ClusterConfig) -> dict:
    """A batch run on a cluster of its own: deploy, then `specserve bench` against it."""
    k8s = config.kubernetes
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": f"{k8s.name}-bench", "labels": _labels(k8s)},
        "spec": {
            "entrypoint": f"python -m cluster.job --config {k8s.config_in_image} --bench "
                          f"--concurrency 1 8 --num-requests 16 --hf-prompts 0",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "rayClusterSpec": ray_cluster_spec(config, serve_probes=False),
        },
    }


def ray_cluster_spec(config: ClusterConfig, serve_probes: bool) -> dict:
    """serve_probes: pods are ready when their Serve ingress answers (a RayService). A RayJob's
    cluster has no Serve until its job deploys it, so its pods keep KubeRay's own probes."""
    k8s = config.kubernetes
    head_params = {"num-cpus": "0", "dashboard-host": "0.0.0.0", "metrics-export-port": str(METRICS_PORT)}
    return {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 120},
        "headGroupSpec": {"rayStartParams": head_params,
                          "template": _pod("ray-head", k8s, k8s.head, 2, 0, serve_probes, head=True)},
        "workerGroupSpecs": [_worker_group(config, pool, serve_probes) for pool in _POOLS if pool in config.pool_names],
    }


def _worker_group(config: ClusterConfig, pool_name: str, serve_probes: bool) -> dict:
    pool = getattr(config.pools, pool_name)
    tp_size = getattr(pool, "tp_size", 1)
    per_node = replicas_per_node(pool.resources, tp_size)
    node = _node_resources(pool.resources, tp_size, per_node)
    params = {"num-cpus": _number(node["CPU"]), "metrics-export-port": str(METRICS_PORT)}
    if node["GPU"]:
        params["num-gpus"] = str(node["GPU"])
    if pool.resources.custom:
        # KubeRay passes this string to `ray start --resources`: JSON inside quotes.
        custom = {name: json.loads(_number(amount)) for name, amount in node["custom"].items()}
        params["resources"] = '"' + json.dumps(custom, separators=(",", ":")).replace('"', '\\"') + '"'
    low, high = (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas) if pool.autoscaling else (pool.replicas,) * 2
    nodes = lambda replicas: math.ceil(replicas / per_node)    # noqa: E731 - nodes that hold them
    return {
        "groupName": _group_name(pool_name, pool.resources),
        "replicas": nodes(pool.initial_replicas), "minReplicas": nodes(low), "maxReplicas": nodes(high),
        "rayStartParams": params,
        "template": _pod("ray-worker", config.kubernetes, getattr(config.kubernetes, pool_name),
                         math.ceil(node["CPU"]) + 1, node["GPU"], serve_probes),
    }


def replicas_per_node(resources: Resources, tp_size: int) -> int:
    """How many of a pool's replicas one node holds: one, unless a replica reserves a fraction
    of a GPU, when as many as fit the whole GPUs of its node (0.5 -> 2, 0.3 -> 3, 1.5 -> 1 on 2)."""
    gpus = resources.num_gpus * tp_size
    if not gpus or float(gpus).is_integer():
        return 1
    return max(1, int(math.ceil(gpus) // gpus))


def _node_resources(resources: Resources, tp_size: int, per_node: int = 1) -> dict:
    """A node's resources: per_node replicas of tp_size shards of the per-shard resources, its
    GPUs a whole number."""
    scale = tp_size * per_node
    return {"CPU": resources.num_cpus * scale, "GPU": math.ceil(resources.num_gpus * tp_size),
            "custom": {name: amount * scale for name, amount in resources.custom.items()}}


def _group_name(pool_name: str, resources: Resources) -> str:
    kinds = sorted(resources.custom)
    return kinds[0].replace("_", "-").lower() if kinds else pool_name


def _pod(container: str, k8s: KubernetesConfig, shape: PodShape, cpu: int, gpus: int, serve_probe: bool,
         head: bool = False) -> dict:
    """A pod template; Ray's own processes get a CPU beyond the replicas' share."""
    limits = {"cpu": str(max(cpu, 1)), "memory": shape.memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    ports = [{"containerPort": SERVE_PORT, "name": "serve"}, {"containerPort": METRICS_PORT, "name": "metrics"}]
    if head:
        ports += [{"containerPort": GCS_PORT, "name": "gcs-server"},
                  {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                  {"containerPort": CLIENT_PORT, "name": "client"}]
    container_spec = {"name": container, "image": k8s.image, "imagePullPolicy": "IfNotPresent",
                      "ports": ports, "resources": {"limits": limits, "requests": dict(limits)}}
    if serve_probe:
        # The node's ingress (HAProxy, or Serve's proxy: server.ingress) answers /-/healthz once
        # it runs: a pod is ready to take traffic from the Service when its ingress is.
        container_spec["readinessProbe"] = {"httpGet": {"path": "/-/healthz", "port": SERVE_PORT},
                                            "initialDelaySeconds": 10, "periodSeconds": 5, "failureThreshold": 12}
    spec = {"containers": [container_spec]}
    if gpus:
        # Docker's 64 MB /dev/shm is too small for NCCL's buffers (and Ray's object store
        # warns): a memory-backed one, as KubeRay's GPU samples mount.
        container_spec["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if shape.node_selector:
        spec["nodeSelector"] = dict(shape.node_selector)
    return {"spec": spec}


def _serve_service(k8s: KubernetesConfig) -> dict:
    return {"metadata": {"name": f"{k8s.name}-serve", "labels": _labels(k8s)},
            "spec": {"type": k8s.service_type,
                     "ports": [{"name": "serve", "port": 80, "targetPort": SERVE_PORT, "protocol": "TCP"}]}}


def _labels(k8s: KubernetesConfig) -> dict:
    return {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/instance": k8s.name}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, readable in the manifest."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _dump(document: dict) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=100)
