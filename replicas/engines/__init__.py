"""The engine seam: what a draft or target deployment needs from the engine it holds.

A deployment (replicas/deployments.py) batches the calls of many sequences and hands each
batch to its engine; the engine owns the model(s) and the KV caches. A draft deployment holds
a Proposer, a target deployment a Verifier. The acceptance rule (replicas/speculative.py,
replicas/sampling.py) is not part of any engine's contract: the Hugging Face engines apply
it themselves, and an engine that brings its own (vLLM's rejection sampler) says so.

Engines are chosen from cluster.yaml by `build_engine`: `engine: huggingface` runs the model
with transformers, in the replica's process when `tp_size` is 1, or as a tensor-parallel
group of `tp_size` shards (replicas/shard_group.py) otherwise.
"""

from __future__ import annotations

from typing import Literal, Protocol

from cluster.config import DraftPoolConfig, ModelSpec, TargetPoolConfig
from replicas.engines.huggingface import DraftEngine, Runner, TargetEngine
from replicas.protocol import Proposal, ProposeRequest, RowError, Verification, VerifyRequest

__all__ = ["DraftEngine", "Proposer", "TargetEngine", "Verifier", "build_engine"]


class _Engine(Protocol):
    def release(self, seq_id: str) -> None:
        """Forget a finished sequence's caches."""

    def describe(self) -> dict:
        """The engine's state for operators: kind, shards, cache occupancy."""

    def holds(self, seq_id: str) -> bool:
        """Whether the engine has the sequence's caches (tests of cache affinity ask)."""

    def cost_profile(self) -> dict:
        """ms of one forward pass by sequences and new positions each (router/goodput.py)."""


class Proposer(_Engine, Protocol):
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal | RowError]:
        """k draft tokens per request (and the distributions q they were drawn from)."""


class Verifier(_Engine, Protocol):
    def verify(self, requests: list[VerifyRequest]) -> list[Verification | RowError]:
        """One forward pass over every request's last token and drafts, then the acceptance rule."""


def build_engine(role: Literal["draft", "target"], spec: ModelSpec,
                 pool: DraftPoolConfig | TargetPoolConfig, max_seq_len: int) -> Proposer | Verifier:
    """max_seq_len: the longest sequence served (limits.context_length), the length of every
    KV slot (replicas/kv_cache.py)."""
    runner = _runner(spec, pool, max_seq_len)
    return DraftEngine(runner) if role == "draft" else TargetEngine(runner)


def _runner(spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig, max_seq_len: int) -> Runner:
    if pool.tp_size == 1:
        from replicas.loading import load_causal_lm
        from replicas.model_runner import ModelRunner

        return ModelRunner(load_causal_lm(spec), pool.kv_cache.max_tokens, max_seq_len)
    from replicas.shard_group import launch_in_placement_group

    return launch_in_placement_group(spec, pool.kv_cache.max_tokens, max_seq_len, pool.tp_size,
                                     pool.resources.ray_actor_options())
