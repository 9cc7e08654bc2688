"""cluster.yaml -> the Ray Serve application: draft pool, target pool, router."""

from __future__ import annotations

from typing import Callable

from ray.serve import Application
from ray.serve.config import BackpressureConfig

from cluster.config import ClusterConfig
from replicas.deployments import DraftPool, TargetPool
from router.ingress import Router
from router.routing import CACHE_AFFINITY

APP_NAME = "specserve"
# Router slots beyond its gate's running and queued requests, for health checks, model
# listings and the gate's own refusals (a fraction of a millisecond each): with 64, a burst of
# 400 clients on the default cluster overflowed into Serve's plain-text 429s at the proxy.
CONTROL_HEADROOM = 1024


def build_app(config: ClusterConfig) -> Application:
    pools = config.pools
    draft = DraftPool.options(
        num_replicas=pools.draft.replicas,
        max_ongoing_requests=pools.draft.max_ongoing_requests,
        request_router_config=CACHE_AFFINITY,
        ray_actor_options=pools.draft.resources.ray_actor_options(),
    ).bind(config.models.draft, pools.draft.kv_cache, pools.draft.batching)
    target = TargetPool.options(
        num_replicas=pools.target.replicas,
        max_ongoing_requests=pools.target.max_ongoing_requests,
        request_router_config=CACHE_AFFINITY,
        ray_actor_options=pools.target.resources.ray_actor_options(),
    ).bind(config.models.target, pools.target.kv_cache, pools.target.batching)
    router = pools.router
    return Router.options(
        num_replicas=router.replicas,
        # The router's own gate admits and queues generation requests (router/gate.py); Serve
        # lets through that many and room for /health and for the gate's quick refusals.
        max_ongoing_requests=router.max_ongoing_requests + router.max_queued_requests + CONTROL_HEADROOM,
        # The last line, when even that room is taken: Serve's own 429 (a plain-text body).
        max_queued_requests=CONTROL_HEADROOM,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=router.retry_after_s),
        ray_actor_options=router.resources.ray_actor_options(),
    ).bind(draft, target, config)


def ensure_placeholder_models(config: ClusterConfig, say: Callable[[str], None] = print) -> None:
    """Build the UNTRAINED placeholder models that cluster.yaml asks for and that are missing.
    The tokenizer is fitted deterministically, so folders built at different times agree."""
    from replicas.tiny_models import build_placeholder_pair

    folders = {}
    for spec in (config.models.target, config.models.draft):
        if spec.placeholder is not None and not (spec.path / "config.json").is_file():
            say(f"building an UNTRAINED placeholder {spec.placeholder} model (random weights) at {spec.path}")
            folders[spec.placeholder] = spec.path
    if folders:
        build_placeholder_pair(folders.get("target"), folders.get("draft"))
