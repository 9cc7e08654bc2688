"""The draft engine proposes tokens; the target engine verifies them. Both sit on a
ModelRunner, so a sequence they hold costs only its new positions."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from replicas.model_runner import ModelRunner
from replicas.protocol import Proposal, ProposeRequest, Verification, VerifyRequest
from replicas.sampling import make_generator, sample, warped_probs
from replicas.speculative import greedy_round, sampled_round


class DraftEngine:
    def __init__(self, model: PreTrainedModel, max_sequences: int):
        self.runner = ModelRunner(model, max_sequences)

    def propose(self, request: ProposeRequest) -> Proposal:
        """k autoregressive draft steps; returns the ids and, when sampling, q [k, V]."""
        tokens, drafts, rows, fed = list(request.tokens), [], [], 0
        generator = make_generator(request.seed)
        for _ in range(request.k):
            step = self.runner.extend(request.seq_id, tokens, num_logits=1)
            fed += step.positions_fed
            if request.sampling.greedy:
                token = int(step.logits[0].argmax())
            else:
                q = warped_probs(step.logits, request.sampling)[0]  # [V]
                token = sample(q, generator)
                rows.append(q)
            drafts.append(token)
            tokens.append(token)
        probs = torch.stack(rows) if rows else None
        return Proposal(drafts, probs, fed)

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)


class TargetEngine:
    def __init__(self, model: PreTrainedModel, max_sequences: int):
        self.runner = ModelRunner(model, max_sequences)

    def verify(self, requests: list[VerifyRequest]) -> list[Verification]:
        """One forward pass per sequence over its last token and its drafts, then the
        speculative sampling rule. Takes a list so that batching can come in behind it."""
        return [self._verify_one(request) for request in requests]

    def _verify_one(self, request: VerifyRequest) -> Verification:
        drafts = list(request.draft_tokens)
        step = self.runner.extend(request.seq_id, list(request.tokens) + drafts,
                                  num_logits=len(drafts) + 1)  # logits [k+1, V]
        if request.sampling.greedy:
            outcome = greedy_round(step.logits, drafts)
        else:
            outcome = sampled_round(step.logits, drafts, request.draft_probs, request.sampling,
                                    make_generator(request.seed))
        return Verification(outcome.accepted, outcome.tokens, step.positions_fed)

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
