"""A replica's tensor-parallel group of shards, and the runner that drives it.

Rank 0 lives in the serving replica and is the only rank anything calls; ranks 1..N-1 are
followers. Rank 0 broadcasts each command (extend a batch, release a sequence) over a gloo
group, then every rank runs it on its own ModelRunner, which holds that shard's weights and
its heads' KV caches (replicas/engines/huggingface/tensor_parallel.py). The sharded forward's all-reduces keep the
ranks in lock step, and after each command a one-number all-reduce (how many ranks failed)
tells rank 0 that every rank ended it the same way. So all shards hold the same sequences
and evict the same ones: batched verify and eviction work as in one process.

A shard that dies breaks the group: the next collective fails at once (gloo reports the
closed connection) and rank 0 raises ShardGroupBroken; the replica then ends its process,
so that Serve replaces it whole (placement group and shards), and the router retries the
calls that were in flight on the new replica, which rebuilds caches from their token ids.
NCCL does not notice a dead peer: its collectives wait for it until their timeout. So rank 0
also watches the followers' processes (PeerWatch: the shards share a node, STRICT_PACK);
when one is gone it aborts the NCCL communicators, which fails a collective waiting on it,
marks the group broken, and under Serve ends the replica at once, idle or not.

Followers are Ray actors in bundles 1..N-1 of the replica's placement group (STRICT_PACK keeps
the bundles on one node), or, without Ray, local processes (tests, a GPU box without Ray).
Start-up has two phases, so that a follower that fails to load fails the start instead of
leaving rank 0 waiting at the rendezvous: every rank loads and shards its model, then all
join the process group.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from replicas.engines.protocol import EngineBroken, end_broken_replica
from replicas.engines.huggingface.kv_sizing import kv_cache_tokens
from replicas.engines.huggingface.loading import pick_device
from replicas.engines.huggingface.model_runner import ExtendCall, Extension, ModelRunner
from replicas.engines.huggingface.shard_loading import load_shard

if TYPE_CHECKING:     # the config's types only: the engines run without pydantic (gpu_check)
    from cluster.config import ModelSpec

logger = logging.getLogger("ray.serve")
# Followers wait for rank 0's next command in a collective: an idle replica must not time
# out. A dead peer is still noticed at once (its connection closes).
_COLLECTIVE_TIMEOUT = timedelta(days=7)
_LOAD_TIMEOUT_S = 600.0
_PEER_POLL_S = 0.5


class ShardGroupBroken(EngineBroken):
    """A shard died or the shards disagree: the replica cannot go on and must be replaced."""


@dataclass(frozen=True)
class ShardPlan:
    spec: ModelSpec
    max_cached_tokens: int | str     # or "auto": each shard sizes its cache (kv_sizing.py)
    world: int
    init_method: str             # tcp://host:port of rank 0's rendezvous
    max_seq_len: int | None = None   # every KV slot's length (None: the model's positions)
    prefix_caching: bool = True      # model_runner.ModelRunner's
    kv_memory_fraction: float = 0.8  # kv_cache.memory_fraction, for "auto"
    prefill_chunk: int | None = None  # prefill_chunk_tokens


@dataclass(frozen=True)
class ShardInfo:
    rank: int
    pid: int
    node_id: str | None          # the Ray node it runs on (None without Ray)


class Shard:
    """One rank's model shard and caches; `join` connects it to the others."""

    def __init__(self, plan: ShardPlan, rank: int):
        self.plan, self.rank = plan, rank
        self.device = _shard_device(plan.spec, rank)
        model = load_shard(plan.spec, rank, plan.world, self.device)
        tokens = kv_cache_tokens(plan.max_cached_tokens, model, self.device, plan.kv_memory_fraction)
        self.runner = ModelRunner(model, tokens, plan.max_seq_len, prefix_caching=plan.prefix_caching,
                                  prefill_chunk=plan.prefill_chunk)
        self.channel = None

    def join(self) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=self.plan.init_method, rank=self.rank,
                                world_size=self.plan.world, timeout=_COLLECTIVE_TIMEOUT)
        self.channel = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT)   # commands

    def info(self) -> ShardInfo:
        return ShardInfo(self.rank, os.getpid(), _ray_node_id())

    def follow(self) -> None:
        """A follower's life: run rank 0's commands until it says stop or the group breaks."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.channel)
            name, args = box[0]
            if name == "stop":
                return
            failed = False
            try:
                getattr(self.runner, name)(*args)
            except Exception:  # noqa: BLE001 - rank 0 fails the same way and reports it
                failed = True
            _count_failures(failed, self.channel)


class PeerWatch:
    """A thread of rank 0 that polls the followers' processes (on its own node) every
    _PEER_POLL_S and calls on_gone(why) once, when one is gone."""

    def __init__(self, infos: list[ShardInfo], on_gone: Callable[[str], None]):
        here = infos[0].node_id
        self._peers = [info for info in infos[1:] if info.node_id == here]
        self._on_gone = on_gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shard-peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(_PEER_POLL_S):
            gone = [info for info in self._peers if not _process_alive(info.pid)]
            if gone:
                self._on_gone(f"shard rank {gone[0].rank} (pid {gone[0].pid}) is gone")
                return


class ShardedRunner:
    """Rank 0's side: a ModelRunner whose every command the followers run too.
    on_broken(why): called once when the watch finds a follower gone (under Serve: end the
    replica); in any case every later command raises ShardGroupBroken."""

    def __init__(self, shard: Shard, infos: list[ShardInfo], stop_followers: Callable[[], None],
                 on_broken: Callable[[str], None] | None = None):
        self.shard = shard
        self.shards = infos                      # every rank, rank 0 first
        self._stop_followers = stop_followers
        self._on_broken = on_broken
        self.broken: str | None = None
        self._watch = PeerWatch(infos, self._peer_gone)

    def _peer_gone(self, why: str) -> None:
        self.broken = why
        logger.error("tensor-parallel group broken: %s", why)
        if self.shard.device.type == "cuda":
            _abort_nccl()
        if self._on_broken is not None:
            self._on_broken(why)

    @property
    def caches(self):
        return self.shard.runner.caches

    @property
    def vocab_size(self) -> int:
        return self.shard.runner.vocab_size

    @property
    def device(self) -> torch.device:
        return self.shard.runner.device

    @property
    def tp_size(self) -> int:
        return self.shard.plan.world

    def extend_batch(self, calls: list[ExtendCall]) -> list[Extension]:
        return self._command("extend_batch", calls)

    def cached(self, seq_id: str):
        """Rank 0's cached keys and values of the sequence (its own heads)."""
        return self.shard.runner.cached(seq_id)

    def release(self, seq_id: str) -> None:
        self._command("release", seq_id)

    def retire(self, seq_id: str) -> None:
        self._command("retire", seq_id)

    def close(self) -> None:
        self._watch.stop()
        try:
            dist.broadcast_object_list([("stop", ())], src=0, group=self.shard.channel)
        finally:
            self._stop_followers()
            dist.destroy_process_group()

    def _command(self, name: str, *args):
        if self.broken is not None:
            raise ShardGroupBroken(self.broken)
        try:
            dist.broadcast_object_list([(name, args)], src=0, group=self.shard.channel)
        except Exception as exc:
            raise ShardGroupBroken(f"could not reach the other shards: {exc}") from exc
        error = None
        try:
            result = getattr(self.shard.runner, name)(*args)
        except Exception as exc:  # noqa: BLE001 - decided below, with the others' outcome
            error = exc
        try:
            failures = _count_failures(error is not None, self.shard.channel)
        except Exception as exc:
            raise ShardGroupBroken(f"a shard is gone: {exc}") from exc
        if failures not in (0, self.tp_size):
            raise ShardGroupBroken(f"{failures} of {self.tp_size} shards failed {name}: their caches differ")
        if error is not None:
            raise error           # every shard failed alike: an error of this batch, not of the group
        return result


def _count_failures(failed: bool, group) -> int:
    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    return int(flag.item())


def _process_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True          # no /proc (macOS): the signal said it exists


def _abort_nccl() -> None:
    """Abort every NCCL communicator, so a collective waiting on a dead peer fails now (torch's
    API for it is marked experimental: where it fails, the replica still ends)."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group()
    except Exception:  # noqa: BLE001 - best effort; on_broken ends the process anyway
        logger.warning("could not abort the NCCL group", exc_info=True)


def _shard_device(spec: ModelSpec, rank: int) -> torch.device:
    device = pick_device(spec.device)
    if device.type == "cuda":   # under Ray a shard sees only its own GPU, as device 0
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def _ray_node_id() -> str | None:
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


def _rendezvous(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


# ---------------------------------------------------------------- launching the followers

def launch_in_placement_group(spec: ModelSpec, max_cached_tokens: int | str, max_seq_len: int, world: int,
                              shard_options: dict, prefix_caching: bool = True,
                              kv_memory_fraction: float = 0.8, prefill_chunk: int | None = None) -> ShardedRunner:
    """From inside a Ray actor (a Serve replica) that holds bundle 0 of its placement group:
    followers as Ray actors in bundles 1..world-1, each with `shard_options` (num_cpus,
    num_gpus, resources)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    plan = ShardPlan(spec, max_cached_tokens, world, _rendezvous(ray.util.get_node_ip_address()), max_seq_len,
                     prefix_caching, kv_memory_fraction, prefill_chunk)
    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError(f"tp_size {world} needs the replica to run in a placement group of {world} bundles")
    actor = ray.remote(_RayFollower)
    followers = [actor.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        max_restarts=0, **shard_options).remote(plan, rank) for rank in range(1, world)]
    shard = Shard(plan, 0)
    ray.get([f.loaded.remote() for f in followers], timeout=_LOAD_TIMEOUT_S)
    joins = [f.join.remote() for f in followers]
    shard.join()
    infos = [shard.info()] + ray.get(joins)
    for follower in followers:
        follower.follow.remote()
    return ShardedRunner(shard, infos, lambda: [ray.kill(f) for f in followers], on_broken=end_broken_replica)


class _RayFollower:
    """A follower rank as a Ray actor (made remote in launch_in_placement_group, so that this
    module imports without Ray)."""

    def __init__(self, plan: ShardPlan, rank: int):
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.shard = Shard(plan, rank)

    def loaded(self) -> bool:
        return True

    def join(self) -> ShardInfo:
        self.shard.join()
        return self.shard.info()

    def follow(self) -> None:
        try:
            self.shard.follow()
        finally:
            os._exit(0)    # the group is over: so is this process


def launch_local(spec: ModelSpec, max_cached_tokens: int, world: int, max_seq_len: int | None = None,
                 on_broken: Callable[[str], None] | None = None) -> ShardedRunner:
    """Followers as local processes of this machine; this process is rank 0. on_broken: as
    ShardedRunner's."""
    context = torch.multiprocessing.get_context("spawn")
    plan = ShardPlan(spec, max_cached_tokens, world, _rendezvous("127.0.0.1"), max_seq_len)
    ready = context.Queue()
    processes = [context.Process(target=_follow_in_process, args=(plan, rank, ready), daemon=True)
                 for rank in range(1, world)]
    for process in processes:
        process.start()
    shard = Shard(plan, 0)
    for _ in processes:
        outcome = ready.get(timeout=_LOAD_TIMEOUT_S)
        if isinstance(outcome, str):
            raise RuntimeError(f"a shard failed to load: {outcome}")
    shard.join()
    infos = [shard.info()] + [ShardInfo(rank, p.pid, None) for rank, p in zip(range(1, world), processes)]
    return ShardedRunner(shard, infos, lambda: [p.join(timeout=10) for p in processes], on_broken)


def _follow_in_process(plan: ShardPlan, rank: int, ready) -> None:
    torch.set_num_threads(1)
    try:
        shard = Shard(plan, rank)
    except Exception as exc:  # noqa: BLE001 - told to rank 0, which fails its start
        ready.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        return
    ready.put(rank)
    shard.join()
    shard.follow()
