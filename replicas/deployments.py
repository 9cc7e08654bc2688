"""The draft and target pools as Ray Serve deployments, each holding an engine built from
its pool's config (replicas/engines): a Proposer for the draft pool, a Verifier for the
target pool. The deployment knows nothing of models or caches; the engine knows nothing of
Serve.

The propose (or verify) calls of concurrent sequences are batched continuously
(replicas/batcher.py): whatever queued while the engine was busy runs as the next batched
engine call. Engine work runs on one worker thread per replica, so caches are never touched
by two threads at once and the replica's event loop stays free for health checks and for
queueing the next batch while a forward pass runs.

Each call carries the requests a router gathered (router/gathering.py). Calls reach these
replicas with cache affinity (router/routing.py), set where the application is built
(cluster/app.py), which also gives a tensor-parallel replica its placement group. They come
as Serve handle calls or, from a router that asked for the replica's `channel_address`, over
a direct channel (replicas/direct_channel.py); both join the same batches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve

from cluster.config import DraftPoolConfig, ModelSpec, TargetPoolConfig
from replicas.batcher import Batcher
from replicas.direct_channel import ChannelServer
from replicas.engines import EngineBroken, build_engine
from replicas.engines.protocol import end_broken_replica
from replicas.metrics import GAUGE_REFRESH_S, PoolMetrics, refresh_every
from replicas.protocol import Proposal, ProposeRequest, RowError, Verification, VerifyRequest

logger = logging.getLogger("ray.serve")


class _ModelReplica:
    role: str
    batched_method: str          # the engine method that takes a list of calls

    def __init__(self, spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig, max_seq_len: int,
                 channel_key: bytes):
        logger.info("loading %s model from %s (%s, %s, tp_size %d)", self.role, spec.path, spec.dtype,
                    spec.device, pool.tp_size)
        # Everything the engine computes, its start-up passes included, runs on this one thread.
        # OpenMP (llama.cpp's threads, torch's) keeps a team of threads for each thread that
        # starts parallel work; with a second team on the replica's cores its threads sleep at
        # every barrier instead of spinning: a 1 B Q8_0 step took 62 ms from the thread that
        # built the engine and 70-75 ms (about 500 sleeps a step) from another one.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-model")
        self.engine = self._worker.submit(build_engine, self.role, spec, pool, max_seq_len).result()
        self.startup_passes = self._worker.submit(self.engine.startup_passes).result()   # also warms it up
        logger.info("%s start-up passes (rows, positions, attention, ms): %s", self.role, self.startup_passes)
        self.metrics = PoolMetrics()
        batching = pool.batching
        self.batcher = Batcher(self._run_batch, call_stream,
                               batching.max_batch_size, batching.wait_ms / 1000, batching.wait_for_active)
        self.lookahead_calls = 0     # draft calls that drafted ahead of a window being verified
        self.channel = ChannelServer(channel_key, {self.batched_method: self._submit_all,
                                                   "release": self._release_all})
        self._channel_start: asyncio.Future | None = None
        refresh_every(GAUGE_REFRESH_S, lambda: self.metrics.state(self.batcher.active_sequences,
                                                                  self.engine.describe()))
        logger.info("%s model ready", self.role)

    async def _run_batch(self, calls: list) -> list:
        results = await self._on_worker(getattr(self.engine, self.batched_method), calls)
        self.metrics.batch(len(calls), self.batcher.active_sequences, self.engine.describe())
        return results

    async def _on_worker(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except EngineBroken as exc:
            # The replica is beyond repair: end it, so that Serve replaces it whole and the
            # router retries the calls that were in flight on the replacement.
            logger.exception("the %s replica's engine broke", self.role)
            end_broken_replica(f"{self.role}: {exc}")

    async def _submit_all(self, requests: list) -> list:
        """The calls a router gathered; they join the batch of every other router's calls.
        A call that fails is answered with a RowError in its place, not by failing the others.
        Each answer says how long the call spent in this replica (batch windows, queueing,
        the engine), which the router sets against the call's wall time, and how much of
        that it queued behind other batches."""
        arrived = time.perf_counter()
        self.lookahead_calls += sum(getattr(request, "lookahead", False) for request in requests)
        results = await asyncio.gather(*(self.batcher.submit_timed(request) for request in requests),
                                       return_exceptions=True)
        replica_ms = (time.perf_counter() - arrived) * 1000
        queued_ms = max((each[1] for each in results if isinstance(each, tuple)), default=0.0) * 1000
        # A row the engine failed comes back as a RowError result, not a raised one.
        answers = [each[0] if isinstance(each, tuple) else each for each in results]
        return [RowError.of(request.seq_id, answer) if isinstance(answer, Exception)
                else dataclasses.replace(answer, replica_ms=replica_ms, queued_ms=queued_ms)
                for request, answer in zip(requests, answers)]

    async def channel_address(self) -> tuple[str, int]:
        """Where this replica takes direct calls (replicas/direct_channel.py); a router asks
        with a lane's session id, so the answer comes from the replica that serves the lane."""
        if self._channel_start is None:   # once, however many routers ask at the same time
            self._channel_start = asyncio.ensure_future(self.channel.start(ray.util.get_node_ip_address()))
        return await asyncio.shield(self._channel_start)

    async def release(self, seq_id: str) -> None:
        """Drop a finished sequence's cache; batches stop waiting for it."""
        release_streams(self.batcher, seq_id)
        await self._on_worker(self.engine.release, seq_id)

    async def _release_all(self, seq_ids: list[str]) -> None:
        """release, for each of these, over the direct channel (the vLLM target's proposer)."""
        for seq_id in seq_ids:
            await self.release(seq_id)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads from each replica (cluster/autoscaling.py)."""
        return {"active_sequences": float(self.batcher.active_sequences)}

    async def describe(self, seq_id: str | None = None) -> dict:
        """This replica's process, node, batching and engine state (and whether it holds
        seq_id). Called with a sequence's lane as session id, it reports on the replica
        serving it."""
        batcher = self.batcher
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "batches": batcher.batches,
                "mean_batch": round(batcher.calls / batcher.batches, 3) if batcher.batches else 0.0,
                "missed_windows": batcher.missed_windows, "waited_ms": round(batcher.waited_s * 1000, 1),
                "isolation_reruns": batcher.isolation_reruns, "active_sequences": batcher.active_sequences,
                "lookahead_calls": self.lookahead_calls,
                "startup_passes": self.startup_passes,
                **self.engine.describe(),
                "holds": self.engine.holds(seq_id) if seq_id is not None else None}


def call_stream(call: ProposeRequest | VerifyRequest) -> tuple[str, bool]:
    """The stream of calls a call belongs to. A sequence that drafts ahead keeps the draft
    pool busy with two (its windows, its lookaheads), so it counts twice in the demand the
    pool autoscales on."""
    return call.seq_id, getattr(call, "lookahead", False)


def release_streams(batcher: Batcher, seq_id: str) -> None:
    for lookahead in (False, True):
        batcher.release((seq_id, lookahead))


@serve.deployment(name="draft")
class DraftPool(_ModelReplica):
    role, batched_method = "draft", "propose"

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal | RowError]:
        return await self._submit_all(requests)


@serve.deployment(name="target")
class TargetPool(_ModelReplica):
    role, batched_method = "target", "verify"

    async def verify(self, requests: list[VerifyRequest]) -> list[Verification | RowError]:
        return await self._submit_all(requests)
