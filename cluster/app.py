"""cluster.yaml -> the Ray Serve application: draft pool, target pool, router."""

from __future__ import annotations

import secrets
from typing import Callable

from ray.serve import Application
from ray.serve.config import BackpressureConfig

from cluster.autoscaling import pool_autoscaling, router_autoscaling
from cluster.config import ClusterConfig, DraftPoolConfig, ServerConfig, TargetPoolConfig
from replicas.deployments import DraftPool, TargetPool
from router.ingress import Router
from router.routing import CACHE_AFFINITY, lane_count, lane_name

APP_NAME = "specserve"
# Router slots beyond its gate's running and queued requests, for health checks, model
# listings and the gate's own refusals (a fraction of a millisecond each): with 64, a burst of
# 400 clients on the default cluster overflowed into Serve's plain-text 429s at the proxy.
CONTROL_HEADROOM = 1024
# A dead vLLM engine fails every request its replica takes until Serve replaces the replica,
# after three failed health checks: at Serve's default period (10 s) that is half a minute.
VLLM_HEALTH_CHECK_PERIOD_S = 2.0
# Ray Serve's HAProxy ingress (server.ingress: haproxy): HAProxy takes the HTTP port and hands
# each connection to a router replica's own HTTP server. Serve's Python proxy instead relays
# every request, and every streamed chunk back, through a Ray call in a process of its own:
# on the default cluster that proxy took more CPU than the router at 16 streams, on the same
# two cores as the engines (docs/BENCHMARKS.md). Both the controller (which starts HAProxy)
# and the router replicas (which open their own HTTP ports) read the switch from their
# environment. A router replica that stops keeps its port open for a draining period so that
# a load balancer notices it going; HAProxy is told at once by Serve's controller (and checks
# every 250 ms while a server changes state), so 2 s, not Serve's 30 s for an unknown one: every
# router stop (Ctrl-C, a scale-down, a redeploy) would wait that long.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def ingress_env(server: ServerConfig) -> dict[str, str]:
    """The environment the Serve controller and the router replicas need for server.ingress."""
    return dict(HAPROXY_ENV) if server.ingress == "haproxy" else {}


def controller_options(server: ServerConfig) -> dict | None:
    """serve.start's controller_options (and a Serve config's): they apply where Serve starts;
    a Serve already running keeps its own ingress."""
    env = ingress_env(server)
    return {"runtime_env": {"env_vars": env}} if env else None


def build_app(config: ClusterConfig) -> Application:
    pools = config.pools
    # Signs the router's direct calls to the model replicas (replicas/direct_channel.py): new
    # with every build, known to this application's processes only.
    channel_key = secrets.token_bytes(32)
    draft = None if config.models.draft is None else DraftPool.options(**_model_pool_options(pools.draft)).bind(
        config.models.draft, pools.draft, config.limits.context_length, channel_key)
    if pools.target.engine == "vllm":
        from replicas.engines.vllm.target import VllmTargetPool   # imports vLLM only where the replica runs

        target = VllmTargetPool.options(**_model_pool_options(pools.target),
                                        health_check_period_s=VLLM_HEALTH_CHECK_PERIOD_S).bind(
            config.models.target, pools.target, config.limits.context_length, channel_key, draft,
            config.speculation.k, [lane_name(i) for i in range(lane_count(pools))], pools.draft.call_timeout_ms / 1000,
            config.speculation.method, config.speculation.suffix_cache_tokens)
    else:
        target = TargetPool.options(**_model_pool_options(pools.target)).bind(
            config.models.target, pools.target, config.limits.context_length, channel_key)
    router = pools.router
    router_actor = router.resources.ray_actor_options()
    if ingress_env(config.server):
        router_actor["runtime_env"] = {"env_vars": ingress_env(config.server)}
    return Router.options(
        **_replica_count(router, router_autoscaling),
        # The router's own gate admits and queues generation requests (router/gate.py); Serve
        # lets through that many and room for /health and for the gate's quick refusals.
        max_ongoing_requests=router.max_ongoing_requests + router.max_queued_requests + CONTROL_HEADROOM,
        # The last line, when even that room is taken: Serve's own 429 (a plain-text body).
        max_queued_requests=CONTROL_HEADROOM,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=router.retry_after_s),
        ray_actor_options=router_actor,
    ).bind(draft, target, config, channel_key)


def _model_pool_options(pool: DraftPoolConfig | TargetPoolConfig) -> dict:
    """A model pool's Serve options. A replica of tp_size shards reserves them together: one
    placement group bundle per shard, STRICT_PACK so that all are on one node; the replica
    (rank 0) runs in bundle 0 and starts the other shards in bundles 1.. (replicas/engines/huggingface/shard_group.py)."""
    actor = pool.resources.ray_actor_options()
    if pool.engine == "vllm" and pool.tp_size > 1:
        # vLLM's own workers hold the shards' GPUs (replicas/engines/vllm/target.py): the replica
        # in bundle 0 keeps its CPUs and leaves that bundle's GPU to its worker.
        actor["num_gpus"] = 0
    options = {**_replica_count(pool, pool_autoscaling), "max_ongoing_requests": pool.max_ongoing_requests,
               "request_router_config": CACHE_AFFINITY, "ray_actor_options": actor}
    if pool.tp_size > 1:
        options["placement_group_bundles"] = [pool.resources.bundle()] * pool.tp_size
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def _replica_count(pool, autoscaling_config) -> dict:
    if pool.autoscaling is None:
        return {"num_replicas": pool.replicas}
    return {"autoscaling_config": autoscaling_config(pool.autoscaling)}


def ensure_gguf_files(config: ClusterConfig, say: Callable[[str], None] = print) -> None:
    """Write the GGUF files cluster.yaml names that are missing, from their tokenizer folders'
    safetensors (replicas/engines/llamacpp/gguf_export.py): the bundled pair needs no hub."""
    for role, spec in config.models.specs().items():
        if spec.is_gguf and not spec.path.is_file() and spec.gguf_buildable:
            try:
                from replicas.engines.llamacpp.gguf_export import write_if_missing
            except ImportError as exc:
                raise SystemExit(f"models.{role}.path {spec.path}: writing it needs the gguf package; install "
                                 f"specserve[llamacpp] ({exc})") from exc
            say(f"writing {spec.path} ({spec.gguf_type}) from {spec.tokenizer}")
            write_if_missing(spec)


def ensure_placeholder_models(config: ClusterConfig, say: Callable[[str], None] = print) -> None:
    """Build the UNTRAINED placeholder models that cluster.yaml asks for and that are missing.
    The tokenizer is fitted deterministically, so folders built at different times agree."""
    folders = {}
    for spec in config.models.specs().values():
        if spec.placeholder is not None and not (spec.path / "config.json").is_file():
            say(f"building an UNTRAINED placeholder {spec.placeholder} model (random weights) at {spec.path}")
            folders[spec.placeholder] = spec.path
    if folders:
        from training.tiny_models import build_placeholder_pair   # only then: it fits a tokenizer

        build_placeholder_pair(folders.get("target"), folders.get("draft"))
