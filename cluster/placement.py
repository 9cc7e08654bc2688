"""Can the cluster's nodes host the pools? Checked before deploying, from cluster.yaml and the
nodes Ray reports, so that `specserve up` says which pool and which resource is missing
instead of waiting for replicas that will never be scheduled.

A replica of a pool needs the pool's resources on one node; a replica of tp_size shards
needs tp_size times a shard's resources on one node (its bundles are STRICT_PACK). Pools are
placed in the order target, draft, router, each replica first-fit on the nodes' remaining
resources: the same greedy choice a scheduler would make, so a pool reported short is short
(the check can miss only cases where a cleverer packing would fit what first-fit does not).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ClusterConfig, Resources

NodeResources = dict[str, float]
_POOLS = ("target", "draft", "router")


@dataclass(frozen=True)
class Shortfall:
    pool: str
    placed: int                    # replicas the nodes have room for
    wanted: int
    per_replica: NodeResources     # what one replica needs on one node
    missing: NodeResources         # per resource, what a replica needs beyond any node's room

    def message(self) -> str:
        need = _spell(self.per_replica)
        lacking = (f"missing: {_spell(self.missing)} on one node" if self.missing
                   else "no single node has all of it free")
        return (f"pools.{self.pool}: the cluster has room for {self.placed} of {self.wanted} replicas "
                f"(each needs {need} on one node); {lacking}")


def shortfalls(config: ClusterConfig, nodes: list[NodeResources]) -> list[Shortfall]:
    """The pools that the nodes (their total resources) cannot host in full."""
    free = [dict(node) for node in nodes]
    found = []
    for name in (name for name in _POOLS if name in config.pool_names):
        pool = getattr(config.pools, name)
        need = _replica_needs(pool.resources, getattr(pool, "tp_size", 1))
        wanted = pool.initial_replicas          # what must start; autoscaling may want more later
        placed = sum(_take(free, need) for _ in range(wanted))
        if placed < wanted:
            most = {r: max((node.get(r, 0.0) for node in free), default=0.0) for r in need}
            missing = {r: round(need[r] - most[r], 6) for r in need if most[r] < need[r]}
            found.append(Shortfall(name, placed, wanted, need, missing))
    return found


def alive_nodes() -> list[NodeResources]:
    """The total resources of every live node of the connected Ray cluster."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def _replica_needs(resources: Resources, tp_size: int) -> NodeResources:
    return {name: amount * tp_size for name, amount in resources.bundle().items()}


def _take(free: list[NodeResources], need: NodeResources) -> bool:
    for node in free:
        if all(node.get(r, 0.0) + 1e-9 >= amount for r, amount in need.items()):
            for r, amount in need.items():
                node[r] = node.get(r, 0.0) - amount
            return True
    return False


def _spell(resources: NodeResources) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(resources.items())) + "}"
