"""The default HTTP ingress: HAProxy in front of the router replicas' own HTTP servers
(server.ingress: haproxy, cluster/app.py), on the session's real Ray."""

from __future__ import annotations

import httpx


def test_haproxy_serves_the_port_and_hands_requests_to_the_routers_own_http_servers(apps):
    import ray

    classes = [ray.get_actor(actor["name"], namespace=actor["namespace"])
               ._ray_actor_creation_function_descriptor.class_name
               for actor in ray.util.list_named_actors(all_namespaces=True)]
    assert "HAProxyManager" in classes, "Serve runs its Python proxy, not the HAProxy ingress"
    # Each router replica answers HTTP itself, on a port of Serve's direct-ingress range: the
    # app's own /health (under its route prefix), with no proxy or HAProxy between.
    answered = [port for port in range(30000, 30100) if _health(port, "/copy")]
    assert answered, "no router replica answers HTTP on its own port"


def _health(port: int, prefix: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{prefix}/health", timeout=0.5).json() == {"status": "ok"}
    except (httpx.HTTPError, ValueError):
        return False
