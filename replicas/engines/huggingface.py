"""The Hugging Face engines: the draft engine proposes tokens, the target engine verifies
them. Both take the calls of many sequences at once and run them as batched forward passes
on a runner that keeps the sequences' KV caches, so a sequence they hold costs only its new
positions. The runner is a ModelRunner (one process) or a ShardedRunner (a tensor-parallel
group, replicas/shard_group.py): the same calls, the same logits.

A failure in one sequence's row (its sampling, its numerics) becomes a RowError in that
sequence's place of the results; the batch's other rows are answered as usual.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from transformers import PreTrainedModel

from replicas.kv_cache import KVCacheStore
from replicas.model_runner import ExtendCall, Extension, ModelRunner
from replicas.protocol import Proposal, ProposeRequest, RowError, Verification, VerifyRequest
from replicas.sampling import NonFiniteDistribution, make_generator, sample, warped_probs
from replicas.speculative import greedy_round, sampled_round


class Runner(Protocol):
    caches: KVCacheStore
    vocab_size: int

    def extend_batch(self, calls: list[ExtendCall]) -> list[Extension]: ...

    def release(self, seq_id: str) -> None: ...


class _Engine:
    def __init__(self, runner: Runner):
        self.runner = runner

    @classmethod
    def on_model(cls, model: PreTrainedModel, max_cached_tokens: int):
        """The engine over one in-process model (tests, offline measurement)."""
        return cls(ModelRunner(model, max_cached_tokens))

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)

    def describe(self) -> dict:
        caches = self.runner.caches
        shards = getattr(self.runner, "shards", None)
        return {"engine": "huggingface", "tp_size": len(shards) if shards else 1,
                "shards": [vars(s) for s in shards] if shards else None,
                "cached_sequences": len(caches), "cached_tokens": caches.cached_tokens,
                "max_cached_tokens": caches.max_tokens, "evictions": caches.evictions}

    def holds(self, seq_id: str) -> bool:
        return seq_id in self.runner.caches

    def cost_profile(self, rows=(1, 2, 4, 8, 16), positions=(1, 2, 3, 5, 9), context: int = 64,
                     repeats: int = 3) -> dict:
        """Median ms of one forward pass over R sequences that each compute N new positions on
        top of `context` cached ones, for R in `rows` and N in `positions`: a decode step of R
        sequences is N = 1, a verify of k drafts N = k + 1. The router chooses k from it
        (router/goodput.py); measuring it also warms the engine up."""
        table = [[self._forward_ms(count, new, context, repeats) for new in positions] for count in rows]
        return {"rows": list(rows), "positions": list(positions), "ms": table}

    def _forward_ms(self, count: int, new: int, context: int, repeats: int) -> float:
        vocab = self.runner.vocab_size
        calls = [ExtendCall(f"_profile-{count}-{new}-{i}",
                            [(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(context + new)], new)
                 for i in range(count)]
        self.runner.extend_batch(calls)          # the contexts, not timed
        times = []
        for _ in range(repeats):                 # the last `new` positions of each, again
            started = time.perf_counter()
            self.runner.extend_batch(calls)
            times.append((time.perf_counter() - started) * 1000)
        for call in calls:
            self.runner.release(call.seq_id)
        return round(sorted(times)[len(times) // 2], 3)


class DraftEngine(_Engine):
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal | RowError]:
        """k autoregressive draft steps per request; step s of every request that still wants
        tokens runs in one batched forward pass. Returns ids and, when sampling, q [k, V]."""
        started = time.perf_counter()
        tokens = [list(r.tokens) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        failures: dict[int, RowError] = {}
        fed, batch_rows = [0] * len(requests), []
        generators = [make_generator(r.seed) for r in requests]
        for step in range(max(r.k for r in requests)):
            active = [i for i, r in enumerate(requests) if r.k > step and i not in failures]
            if not active:
                break
            extensions = self.runner.extend_batch(
                [ExtendCall(requests[i].seq_id, tokens[i], 1) for i in active])
            for i, extension in zip(active, extensions):
                fed[i] += extension.positions_fed
                try:
                    token = self._choose(extension.logits, requests[i], generators[i], rows[i])
                except Exception as exc:  # noqa: BLE001 - this row alone fails
                    failures[i] = RowError.of(requests[i].seq_id, exc)
                    continue
                drafts[i].append(token)
                tokens[i].append(token)
            batch_rows.append(len(active))
        model_ms = (time.perf_counter() - started) * 1000
        mean_rows = sum(batch_rows) / len(batch_rows) if batch_rows else 0.0
        return [failures.get(i) or Proposal(drafts[i], torch.stack(rows[i]) if rows[i] else None,
                                            fed[i], mean_rows, model_ms, steps=len(batch_rows))
                for i in range(len(requests))]

    @staticmethod
    def _choose(logits: torch.Tensor, request: ProposeRequest, generator, rows: list) -> int:
        if request.sampling.greedy:
            return int(logits[0].argmax())
        q = warped_probs(logits, request.sampling)[0]  # [V]
        rows.append(q)
        return sample(q, generator)


class TargetEngine(_Engine):
    def verify(self, requests: list[VerifyRequest]) -> list[Verification | RowError]:
        """One batched forward pass over every sequence's last token and its drafts, then the
        speculative sampling rule per sequence."""
        started = time.perf_counter()
        extensions = self.runner.extend_batch(
            [ExtendCall(r.seq_id, list(r.tokens) + list(r.draft_tokens), len(r.draft_tokens) + 1)
             for r in requests])  # logits [k+1, V] each
        outcomes = [self._decide_row(r, e.logits) for r, e in zip(requests, extensions)]
        model_ms = (time.perf_counter() - started) * 1000
        return [o if isinstance(o, RowError) else
                Verification(o.accepted, o.tokens, e.positions_fed, e.batch_rows, model_ms, e.batch_positions)
                for o, e in zip(outcomes, extensions)]

    def _decide_row(self, request: VerifyRequest, logits: torch.Tensor):
        try:
            if torch.isnan(logits).any():
                raise NonFiniteDistribution("the target model's logits hold NaN")
            return self._decide(request, logits)
        except Exception as exc:  # noqa: BLE001 - this row alone fails
            self.runner.release(request.seq_id)   # its cache may hold the same bad numbers
            return RowError.of(request.seq_id, exc)

    @staticmethod
    def _decide(request: VerifyRequest, logits: torch.Tensor):
        drafts = list(request.draft_tokens)
        if request.sampling.greedy:
            return greedy_round(logits, drafts)
        return sampled_round(logits, drafts, request.draft_probs, request.sampling, make_generator(request.seed))
