"""What a draft or target deployment needs from the engine it holds (replicas/deployments.py):
a draft replica holds a Proposer, a target replica a Verifier. The acceptance rule
(replicas/speculative.py, replicas/sampling.py) is not part of the contract: the Hugging Face
engine applies it itself, and an engine that brings its own (vLLM's rejection sampler) says so.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from replicas.protocol import Proposal, ProposeRequest, RowError, Verification, VerifyRequest


BROKEN_EXIT_CODE = 70


class EngineBroken(RuntimeError):
    """The engine cannot serve again in this process (a shard of its group is gone, its
    caches disagree): the deployment ends the replica so that Serve replaces it, and the
    router retries the call elsewhere."""


def end_broken_replica(why: str) -> None:
    """End this process: its engine cannot serve again. Serve replaces the replica whole
    (placement group and shards) and the routers retry its calls on the replacement."""
    logging.getLogger("ray.serve").error("the engine broke (%s); exiting so that the replica is replaced", why)
    logging.shutdown()
    os._exit(BROKEN_EXIT_CODE)


class _Engine(Protocol):
    def release(self, seq_id: str) -> None:
        """Forget a finished sequence's caches."""

    def describe(self) -> dict:
        """The engine's state for operators: kind, shards, cache occupancy."""

    def holds(self, seq_id: str) -> bool:
        """Whether the engine has the sequence's caches (tests of cache affinity ask)."""

    def startup_passes(self) -> list:
        """A few timed passes of small shapes, (rows, positions, attention, ms) each: where the
        router's cost model starts (router/cost_model.py)."""


class Proposer(_Engine, Protocol):
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal | RowError]:
        """k draft tokens per request (and the distributions q they were drawn from)."""


class Verifier(_Engine, Protocol):
    def verify(self, requests: list[VerifyRequest]) -> list[Verification | RowError]:
        """One forward pass over every request's last token and drafts, then the acceptance rule."""
