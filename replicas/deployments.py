"""The draft and target pools as Ray Serve deployments.

The propose (or verify) calls of concurrent sequences are batched continuously
(replicas/batcher.py): whatever queued while the model was busy runs as the next batched
engine call. Model work runs on one worker thread per replica, so caches are never touched
by two threads at once and the replica's event loop stays free for health checks and for
queueing the next batch while a forward pass runs.

Each call carries the requests a router gathered (router/gathering.py). Calls reach these
replicas with cache affinity (router/routing.py), set where the application is built
(cluster/app.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from cluster.config import BatchingConfig, KVCacheConfig, ModelSpec
from replicas.batcher import Batcher
from replicas.engines import DraftEngine, TargetEngine
from replicas.loading import load_causal_lm
from replicas.protocol import Proposal, ProposeRequest, RowError, Verification, VerifyRequest

logger = logging.getLogger("ray.serve")


class _ModelReplica:
    role: str
    engine_class: type           # DraftEngine or TargetEngine
    batched_method: str          # the engine method that takes a list of calls

    def __init__(self, spec: ModelSpec, kv_cache: KVCacheConfig, batching: BatchingConfig):
        logger.info("loading %s model from %s (%s, %s)", self.role, spec.path, spec.dtype, spec.device)
        self.engine = self.engine_class(load_causal_lm(spec), kv_cache.max_tokens)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-model")
        run_batch = getattr(self.engine, self.batched_method)
        self.batcher = Batcher(lambda calls: self._on_worker(run_batch, calls), lambda call: call.seq_id,
                               batching.max_batch_size, batching.wait_ms / 1000, batching.wait_for_active)
        logger.info("%s model ready", self.role)

    async def _on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def _submit_all(self, requests: list) -> list:
        """The calls a router gathered; they join the batch of every other router's calls.
        A call that fails is answered with a RowError in its place, not by failing the others."""
        results = await asyncio.gather(*(self.batcher.submit(request) for request in requests),
                                       return_exceptions=True)
        return [RowError.of(request.seq_id, result) if isinstance(result, Exception) else result
                for request, result in zip(requests, results)]

    async def release(self, seq_id: str) -> None:
        """Drop a finished sequence's cache; batches stop waiting for it."""
        self.batcher.release(seq_id)
        await self._on_worker(self.engine.release, seq_id)

    async def describe(self, seq_id: str | None = None) -> dict:
        """This replica's process, batching and cache state (and whether it holds seq_id).
        Called with a sequence's id as session id, it reports on the replica serving it."""
        caches, batcher = self.engine.runner.caches, self.batcher
        return {"pid": os.getpid(), "batches": batcher.batches,
                "mean_batch": round(batcher.calls / batcher.batches, 3) if batcher.batches else 0.0,
                "missed_windows": batcher.missed_windows, "waited_ms": round(batcher.waited_s * 1000, 1),
                "isolation_reruns": batcher.isolation_reruns,
                "cached_sequences": len(caches), "cached_tokens": caches.cached_tokens,
                "max_cached_tokens": caches.max_tokens, "evictions": caches.evictions,
                "holds": seq_id in caches if seq_id is not None else None}


@serve.deployment(name="draft")
class DraftPool(_ModelReplica):
    role, engine_class, batched_method = "draft", DraftEngine, "propose"

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal | RowError]:
        return await self._submit_all(requests)


@serve.deployment(name="target")
class TargetPool(_ModelReplica):
    role, engine_class, batched_method = "target", TargetEngine, "verify"

    async def verify(self, requests: list[VerifyRequest]) -> list[Verification | RowError]:
        return await self._submit_all(requests)
