"""The draft and target pools as Ray Serve deployments.

Model work runs on one worker thread per replica: calls are served in arrival order, the
caches are never touched by two threads at once, and the replica's event loop stays free
for health checks and new calls while a forward pass runs.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from cluster.config import KVCacheConfig, ModelSpec
from replicas.engines import DraftEngine, TargetEngine
from replicas.loading import load_causal_lm
from replicas.protocol import Proposal, ProposeRequest, Verification, VerifyRequest

logger = logging.getLogger("ray.serve")


class _ModelReplica:
    def __init__(self, role: str, spec: ModelSpec):
        logger.info("loading %s model from %s (%s, %s)", role, spec.path, spec.dtype, spec.device)
        self.model = load_causal_lm(spec)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-model")
        logger.info("%s model ready", role)

    async def _on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def release(self, seq_id: str) -> None:
        """Drop a finished sequence's cache."""
        await self._on_worker(self.engine.release, seq_id)

    async def cached_sequences(self) -> int:
        return len(self.engine.runner.caches)


@serve.deployment(name="draft")
class DraftPool(_ModelReplica):
    def __init__(self, spec: ModelSpec, kv_cache: KVCacheConfig):
        super().__init__("draft", spec)
        self.engine = DraftEngine(self.model, kv_cache.max_sequences)

    async def propose(self, request: ProposeRequest) -> Proposal:
        return await self._on_worker(self.engine.propose, request)


@serve.deployment(name="target")
class TargetPool(_ModelReplica):
    def __init__(self, spec: ModelSpec, kv_cache: KVCacheConfig):
        super().__init__("target", spec)
        self.engine = TargetEngine(self.model, kv_cache.max_sequences)

    async def verify(self, requests: list[VerifyRequest]) -> list[Verification]:
        return await self._on_worker(self.engine.verify, requests)
