"""The Hugging Face engine: transformers' weights (loading.py) through a lean Llama forward
(llama_forward.py) over preallocated KV slots (kv_cache.py, kv_storage.py), driven by a model
runner (model_runner.py), one process or a tensor-parallel group of shards (tensor_parallel.py,
shard_group.py), with the Proposer and Verifier on top (engine.py)."""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch

from cluster.config import DraftPoolConfig, ModelSpec, TargetPoolConfig
from replicas.engines.huggingface.engine import DraftEngine, Runner, TargetEngine

__all__ = ["DraftEngine", "TargetEngine", "build"]

logger = logging.getLogger("ray.serve")


def build(role: Literal["draft", "target"], spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig,
          max_seq_len: int) -> DraftEngine | TargetEngine:
    if role == "draft":
        return DraftEngine(_runner(spec, pool, max_seq_len))
    return TargetEngine(_exact_runner(spec, pool, max_seq_len))


def _exact_runner(spec: ModelSpec, pool: TargetPoolConfig, max_seq_len: int) -> Runner:
    """A target in reduced precision runs only where its forward is batch-invariant
    (invariance.py); elsewhere in float32, with a warning. A draft's dtype moves no output."""
    runner = _runner(spec, pool, max_seq_len)
    if pool.tp_size > 1 or runner.model.dtype == torch.float32:    # a group's shards all-reduce: not probed alone
        return runner
    from replicas.engines.huggingface.invariance import batch_invariant

    if batch_invariant(runner):
        return runner
    logger.warning("the target's %s forward is not batch-invariant on this machine (a verify's logits would "
                   "differ from single steps, and speculation would change greedy output): it runs in float32",
                   runner.model.dtype)
    return _runner(spec.model_copy(update={"dtype": "float32"}), pool, max_seq_len)


def _runner(spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig, max_seq_len: int) -> Runner:
    if pool.tp_size == 1:
        from replicas.engines.huggingface.loading import load_causal_lm

        if spec.compile == "on" and spec.compile_cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(spec.compile_cache_dir)   # read when inductor writes
        from replicas.engines.huggingface.model_runner import ModelRunner

        return ModelRunner(load_causal_lm(spec), pool.kv_cache.max_tokens, max_seq_len, compiled=spec.compile == "on")
    from replicas.engines.huggingface.shard_group import launch_in_placement_group

    if spec.compile == "on":
        logger.warning("compile: on does not apply to a tensor-parallel group (its linears all-reduce in hooks); "
                       "the shards run eager")

    return launch_in_placement_group(spec, pool.kv_cache.max_tokens, max_seq_len, pool.tp_size,
                                     pool.resources.ray_actor_options())
