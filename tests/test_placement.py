"""The placement check that `specserve up` makes before deploying: which pool the nodes
cannot host, and which resource is missing."""

from __future__ import annotations


from cluster.placement import shortfalls
from tests.conftest import cluster_config

SMALL = {"CPU": 2.0, "small_gpu": 2.0}
LARGE = {"CPU": 4.0, "large_gpu": 2.0}


def config(zoo, target_replicas=1, tp_size=2, draft_replicas=2):
    pools = {"router": {"resources": {"num_cpus": 0.5}},
             "draft": {"replicas": draft_replicas, "resources": {"num_cpus": 0.5, "custom": {"small_gpu": 1}}},
             "target": {"replicas": target_replicas, "tp_size": tp_size,
                        "resources": {"num_cpus": 1, "custom": {"large_gpu": 1}}}}
    return cluster_config(zoo.target, zoo.drafts["copy"], pools=pools)


def test_a_cluster_of_the_right_kinds_hosts_every_pool(zoo):
    assert shortfalls(config(zoo), [SMALL, LARGE]) == []


def test_more_large_nodes_than_exist_names_the_target_and_large_gpu(zoo):
    [short] = shortfalls(config(zoo, target_replicas=2), [SMALL, LARGE])
    assert (short.pool, short.placed, short.wanted) == ("target", 1, 2)
    assert short.per_replica == {"CPU": 2.0, "large_gpu": 2.0} and short.missing == {"large_gpu": 2.0}
    assert "pools.target" in short.message() and "large_gpu: 2" in short.message()


def test_shards_must_share_one_node(zoo):
    # two large nodes with one large_gpu each: enough in all, but a replica's shards are STRICT_PACK
    halves = [SMALL, {"CPU": 2.0, "large_gpu": 1.0}, {"CPU": 2.0, "large_gpu": 1.0}]
    [short] = shortfalls(config(zoo), halves)
    assert (short.pool, short.placed, short.missing) == ("target", 0, {"large_gpu": 1.0})


def test_drafts_without_small_nodes_are_reported(zoo):
    [short] = shortfalls(config(zoo), [LARGE])
    assert (short.pool, short.placed, short.wanted, short.missing) == ("draft", 0, 2, {"small_gpu": 1.0})


def test_pools_compete_for_the_same_cpus(zoo):
    # one node of 2.5 CPUs with every kind: the target takes 2, one draft 0.5, nothing is left
    everything = [{"CPU": 2.5, "small_gpu": 2.0, "large_gpu": 2.0}]
    found = {s.pool: (s.placed, s.missing) for s in shortfalls(config(zoo), everything)}
    assert found == {"draft": (1, {"CPU": 0.5}), "router": (0, {"CPU": 0.5})}
