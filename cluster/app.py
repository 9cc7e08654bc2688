"""cluster.yaml -> the Ray Serve application: draft pool, target pool, router."""

from __future__ import annotations

from typing import Callable

from ray.serve import Application

from cluster.config import ClusterConfig
from replicas.deployments import DraftPool, TargetPool
from router.ingress import Router
from router.routing import CACHE_AFFINITY

APP_NAME = "specserve"


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
    return Router.options(
        num_replicas=pools.router.replicas,
        max_ongoing_requests=pools.router.max_ongoing_requests,
        ray_actor_options=pools.router.resources.ray_actor_options(),
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
