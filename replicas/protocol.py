"""Messages between the router and the pools. Each call carries the sequence's full token
ids, so any replica can serve it: a cache only saves work, it is never needed for an answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.draft_probs import TopProbs
from replicas.sampling import SamplingParams


# One forward pass of a batched call: (rows, new positions over all rows, attention work: the
# sum over rows of new positions x context length in thousands, ms). router/cost_model.py
# fits a pool's pass time to these.
PassRecord = tuple[int, int, float, float]


@dataclass(frozen=True)
class BatchCost:
    """The passes of one batched engine call, the same object in every row's answer (the
    router counts a batch once, by its id)."""
    batch_id: str
    passes: tuple[PassRecord, ...]


@dataclass(frozen=True)
class ProposeRequest:
    seq_id: str
    tokens: list[int]          # prompt + generated so far
    k: int                     # draft tokens wanted
    sampling: SamplingParams
    seed: int                  # seeds this call's sampling; derived per round by the router
    lookahead: bool = False    # drafted ahead, while the window before it is verified (router/lookahead.py)
    noise_seed: int | None = None   # a seeded request's: each draft is the Gumbel-max choice from q under
                                    # the public noise of its position (replicas/gumbel.py); probs None
    prompt_len: int = 0        # tokens[:prompt_len] is the prompt (penalties count the output after it)


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]                 # k draft ids
    probs: TopProbs | None            # q [k, V] they were sampled from, its top entries; None when greedy
    positions_fed: int                # positions the draft model computed for this call
    batch_rows: float                 # mean sequences per draft forward pass of this call
    model_ms: float                   # wall time of the replica's batched propose
    steps: int = 0                    # draft forward passes that batched propose ran
    replica_ms: float = 0.0           # from the call's arrival at the replica to its answer
    queued_ms: float = 0.0            # of which queued while the replica's engine ran other batches
    batch: BatchCost | None = None  # the batched call's passes, for the router's cost model


@dataclass(frozen=True)
class VerifyRequest:
    seq_id: str
    tokens: list[int]                 # prompt + generated so far (the drafts not included)
    draft_tokens: list[int]           # k >= 0 drafts to check; none gives a plain target step
    draft_probs: TopProbs | torch.Tensor | None  # q [k, V] (replicas/draft_probs.py), None when greedy
    sampling: SamplingParams
    seed: int
    noise_seed: int | None = None     # a seeded request's: the target's token at each position is the
                                      # Gumbel-max choice from p, drafts kept while they equal it
    prompt_len: int = 0               # tokens[:prompt_len] is the prompt (penalties count the output after it)
    logprobs: int | None = None       # the emitted tokens' logprobs, with this many of the most likely
    prompt_logprobs: int | None = None   # and those of tokens[1:] (a first call's: its prompt)
    steps: int = 1                    # forward passes the call may run: after the window, up to steps - 1
                                      # single-token steps, each on the token before (the target alone's
                                      # next tokens), ending early after a token of stop_ids
    stop_ids: tuple[int, ...] = ()
    engine_drafts: bool = False       # the request speculates: a lone window without drafts may carry one
                                      # of the target engine's own where its runner computes it for free


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float                            # of the target's raw distribution (replicas/logprobs.py)
    top: tuple[tuple[int, float], ...] = ()   # the most likely ids of that position, most likely first


@dataclass(frozen=True)
class Verification:
    accepted: int              # leading drafts kept
    tokens: list[int]          # accepted drafts + one recovered or bonus token (+ the tokens of the
                               # call's further single-token steps, VerifyRequest.steps)
    positions_fed: int         # positions the target model computed for this sequence
    batch_rows: int            # sequences in the forward pass that verified it
    model_ms: float            # wall time of the replica's batched verify
    batch_positions: int = 0   # positions that forward pass computed, over all its sequences
    replica_ms: float = 0.0    # from the call's arrival at the replica to its answer
    queued_ms: float = 0.0     # of which queued while the replica's engine ran other batches
    logprobs: tuple[TokenLogprobs, ...] | None = None          # one per token, when asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None   # one per token of tokens[1:], when asked
    batch: BatchCost | None = None   # the batched call's passes, for the router's cost model


@dataclass(frozen=True)
class GenerateRequest:
    """A whole generation, for a target engine that runs its own rounds (vLLM,
    replicas/engines/vllm/target.py): it streams new token ids."""
    seq_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None          # as VerifyRequest's
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class EngineStep:
    """What a target engine that runs its own rounds streams: one step's new tokens, their
    logprobs (and, in the first step, the prompt's) when the request asked for them."""
    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None


class RowError(Exception):
    """One sequence's part of a batched call failed (bad numerics, an exception in its row).
    It is returned in that sequence's place of the call's results, so every other sequence
    of the batch and of the gathered call gets its answer as if the failure never happened."""

    def __init__(self, seq_id: str, kind: str, message: str):
        super().__init__(seq_id, kind, message)   # all in args: it crosses processes pickled
        self.seq_id, self.kind, self.message = seq_id, kind, message

    @classmethod
    def of(cls, seq_id: str, exc: BaseException) -> "RowError":
        return exc if isinstance(exc, RowError) else cls(seq_id, type(exc).__name__, str(exc))

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"
