"""A model replica computes on one thread only (replicas/deployments.py): the engine is built,
warmed up and called on its worker thread. OpenMP keeps a team of threads for each thread that
starts parallel work, and with a second team on the replica's cores its threads sleep at every
barrier instead of spinning (docs/BENCHMARKS.md: a llama.cpp step 62 ms from one thread, 70-75
ms once another had computed first). The replica is the real class, outside Serve, on the
bundled target; the engine's own methods run, each wrapped only to note its thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from replicas import deployments
from replicas.protocol import VerifyRequest
from replicas.sampling import GREEDY
from tests.conftest import cluster_config


def test_the_engine_is_built_warmed_up_and_called_on_one_thread(monkeypatch):
    threads: list[tuple[str, str]] = []

    def noting(name, fn):
        def run(*args, **kwargs):
            threads.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return run

    real_build = deployments.build_engine

    def build(*args):
        engine = noting("build", real_build)(*args)
        engine.startup_passes = noting("startup_passes", engine.startup_passes)
        engine.verify = noting("verify", engine.verify)
        return engine

    monkeypatch.setattr(deployments, "build_engine", build)
    config = cluster_config(Path("models/target"), None)
    replica = deployments.TargetPool.func_or_class(config.models.target, config.pools.target,
                                                   config.limits.context_length, b"k" * 32)
    prompt = list(range(3, 20))
    [verified] = asyncio.run(replica._run_batch([VerifyRequest("a", prompt, [], None, GREEDY, 0)]))
    assert len(verified.tokens) == 1
    assert [name for name, _ in threads] == ["build", "startup_passes", "verify"]
    assert {thread for _, thread in threads} == {"target-model_0"}, threads
