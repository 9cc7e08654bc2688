"""The Hugging Face engines: the draft engine proposes tokens, the target engine verifies
them. Both take the calls of many sequences at once and run them as batched forward passes
on a runner that keeps the sequences' KV caches, so a sequence they hold costs only its new
positions. The runner is a ModelRunner (one process) or a ShardedRunner (a tensor-parallel
group, replicas/engines/huggingface/shard_group.py): the same calls, the same logits.

A failure in one sequence's row (its sampling, its numerics) becomes a RowError in that
sequence's place of the results; the batch's other rows are answered as usual.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from dataclasses import replace
from typing import Protocol

import torch
from transformers import PreTrainedModel

from replicas.draft_probs import DEFAULT_TOP, TopProbs, cut_to_top
from replicas.engines.huggingface.kv_cache import KVCacheStore
from replicas.grammar import GrammarMasks
from replicas.logits_processing import adjusted_logits
from replicas.logprobs import token_logprobs
from replicas.engines.huggingface.model_runner import ExtendCall, Extension, ModelRunner
from replicas.engines.huggingface.timing import startup_passes
from replicas.protocol import BatchCost, PassRecord, Proposal, ProposeRequest, RowError, Verification, VerifyRequest
from replicas.gumbel import gumbel_choices
from replicas.sampling import (NonFiniteDistribution, check_finite, make_generator, sample, sampleable,
                               warped_probs)
from replicas.speculative import greedy_round, sampled_rounds


class Runner(Protocol):
    caches: KVCacheStore
    vocab_size: int
    device: torch.device

    def extend_batch(self, calls: list[ExtendCall]) -> list[Extension]: ...

    def release(self, seq_id: str) -> None: ...

    def retire(self, seq_id: str) -> None: ...


def _dtype_name(runner: Runner) -> str | None:
    """The dtype the runner's model runs in (a target may fall back to float32, __init__.py)."""
    model = getattr(runner, "model", None)
    return None if model is None else str(model.dtype).removeprefix("torch.")


class _Engine:
    def __init__(self, runner: Runner, grammars: GrammarMasks | None = None, probs_top: int = DEFAULT_TOP):
        """probs_top: a sampled draft's q is cut to this many entries (replicas/draft_probs.py)."""
        self.runner = runner
        self.probs_top = probs_top
        self.grammars = grammars   # a request's grammar as masks (None: a folder without a tokenizer)
        self._batch_ids = (f"{uuid.uuid4().hex[:8]}-{n}" for n in itertools.count())

    @classmethod
    def on_model(cls, model: PreTrainedModel, max_cached_tokens: int, max_seq_len: int | None = None,
                 compiled: bool = False, fused_cpu: bool = False, grammars: GrammarMasks | None = None,
                 probs_top: int = DEFAULT_TOP):
        """The engine over one in-process model (tests, offline measurement)."""
        return cls(ModelRunner(model, max_cached_tokens, max_seq_len, compiled=compiled, fused_cpu=fused_cpu), grammars,
                   probs_top)

    def release(self, seq_id: str) -> None:
        """The sequence has finished (the router says so)."""
        self.runner.retire(seq_id)

    def describe(self) -> dict:
        caches = self.runner.caches
        shards = getattr(self.runner, "shards", None)
        return {"engine": "huggingface", "tp_size": len(shards) if shards else 1,
                "compile_s": getattr(self.runner, "compile_s", None), "dtype": _dtype_name(self.runner),
                "fused_cpu": getattr(self.runner, "fused", False),
                "dtype_scores_ms": getattr(self.runner, "dtype_scores_ms", None),
                "shards": [vars(s) for s in shards] if shards else None,
                "cached_sequences": len(caches) - caches.retired, "retired_sequences": caches.retired,
                "cached_tokens": caches.cached_tokens, "shared_prefix_positions": caches.shared_positions,
                "max_cached_tokens": caches.max_tokens, "evictions": caches.evictions,
                "kv_slots": caches.capacity, "max_kv_slots": caches.max_slots, "slot_moves": caches.moves,
                "reused_positions": caches.reused_positions, "computed_positions": caches.computed_positions,
                "sequence_rows": caches.sequence_rows, "window_rows": caches.window_rows}

    def holds(self, seq_id: str) -> bool:
        return seq_id in self.runner.caches

    def startup_passes(self) -> list[PassRecord]:
        """A few passes of the smallest shapes, timed: the router's cost model starts from
        them (router/cost_model.py) and learns the rest from every call; they also warm the
        engine up."""
        return startup_passes(self.runner)

    def _batch(self, passes: list[PassRecord]) -> BatchCost:
        return BatchCost(next(self._batch_ids), tuple(passes))


def _pass_record(calls: list[tuple[int, int]], started: float) -> PassRecord:
    """A pass over rows that each computed `new` of `length` positions, begun at `started`."""
    return (len(calls), sum(new for new, _ in calls), sum(new * length for new, length in calls) / 1000,
            (time.perf_counter() - started) * 1000)


class DraftEngine(_Engine):
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal | RowError]:
        """k autoregressive draft steps per request; step s of every request that still wants
        tokens runs in one batched forward pass. Returns ids and, when sampling, q [k, V]."""
        started = time.perf_counter()
        tokens = [list(r.tokens) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        failures: dict[int, RowError] = {}
        fed, batch_rows, passes = [0] * len(requests), [], []
        generators = [make_generator(r.seed, self.runner.device) for r in requests]
        for step in range(max(r.k for r in requests)):
            active = [i for i, r in enumerate(requests) if r.k > step and i not in failures]
            if not active:
                break
            pass_started = time.perf_counter()
            extensions = self.runner.extend_batch(
                [ExtendCall(requests[i].seq_id, tokens[i], 1) for i in active])
            chosen = self._choose(active, extensions, requests, generators, rows, failures,
                                  [tokens[i] for i in active])
            for i, extension in zip(active, extensions):
                fed[i] += extension.positions_fed
                if i in chosen:
                    drafts[i].append(chosen[i])
                    tokens[i].append(chosen[i])
            batch_rows.append(len(active))
            passes.append(_pass_record([(e.positions_fed, len(tokens[i])) for i, e in zip(active, extensions)],
                                       pass_started))
        model_ms = (time.perf_counter() - started) * 1000
        mean_rows = sum(batch_rows) / len(batch_rows) if batch_rows else 0.0
        batch = self._batch(passes)
        return [failures.get(i) or Proposal(drafts[i], TopProbs.of(torch.stack(rows[i]), self.probs_top) if rows[i] else None,
                                            fed[i], mean_rows, model_ms, steps=len(batch_rows), batch=batch)
                for i in range(len(requests))]

    def _draft_sampling(self, sampling):
        """The draft follows the request's grammar where it can (its q then wastes no mass on
        tokens the target's masked p rejects); without a tokenizer of its own it drafts
        unmasked, which the acceptance rule keeps exact."""
        return sampling if self.grammars is not None or sampling.grammar is None else replace(sampling, grammar=None)

    def _choose(self, active: list[int], extensions: list[Extension], requests: list[ProposeRequest], generators,
                rows: list[list[torch.Tensor]], failures: dict[int, RowError],
                histories: list[list[int]]) -> dict[int, int]:
        """This step's draft token of each active request, from its logits adjusted by its
        penalties and bias over its history (the tokens before the one drafted): the argmax
        of every greedy row in one transfer; for a seeded request the Gumbel-max choice from q
        at its position; a sample from q for the others (q kept for the target's rule)."""
        logits = {}
        for i, extension, history in zip(active, extensions, histories):
            try:
                logits[i] = adjusted_logits(extension.logits, self._draft_sampling(requests[i].sampling), history,
                                            requests[i].prompt_len, self.grammars)
            except Exception as exc:  # noqa: BLE001 - this row alone fails
                failures[i] = RowError.of(requests[i].seq_id, exc)
        greedy = [i for i in logits if requests[i].sampling.greedy]
        chosen = {i: choices[0] for i, choices in zip(greedy, _argmax_rows([logits[i] for i in greedy]))}
        for i, history in zip(active, histories):
            request = requests[i]
            if request.sampling.greedy or i not in logits:
                continue
            try:
                q = warped_probs(logits[i], request.sampling)[0]  # [V]
                if request.noise_seed is not None:
                    check_finite(q)
                    chosen[i] = int(gumbel_choices(q[None], request.noise_seed, len(history))[0])
                    continue
                q = cut_to_top(q, self.probs_top)              # what is sampled is what is sent
                chosen[i] = sample(q, generators[i])
                rows[i].append(q)
            except Exception as exc:  # noqa: BLE001 - this row alone fails
                failures[i] = RowError.of(requests[i].seq_id, exc)
        return chosen


class TargetEngine(_Engine):
    def verify(self, requests: list[VerifyRequest]) -> list[Verification | RowError]:
        """One batched forward pass over every sequence's last token and its drafts, then the
        speculative sampling rule: for greedy rows one argmax over all of them, for sampled
        rows the batched rule (replicas/speculative.py), both on the model's device. Then the
        further single-token steps that calls ask for (VerifyRequest.steps), batched over the
        rows that still go on: each is a window of no drafts on the tokens so far, so its
        token is the one the target alone would choose next. They save the router a round
        trip per token when it has no drafts to send."""
        if not requests:
            return []
        started = time.perf_counter()
        passes: list[PassRecord] = []
        results = self._windows(requests, passes)
        ended: set[int] = set()
        for step in range(1, max(r.steps for r in requests)):
            going = [i for i, (r, v) in enumerate(zip(requests, results)) if r.steps > step and i not in ended
                     and isinstance(v, Verification) and v.tokens[-1] not in r.stop_ids]
            if not going:
                break
            for i, more in zip(going, self._windows([_next_step(requests[i], results[i], step) for i in going],
                                                    passes)):
                if isinstance(more, RowError):   # the tokens before it stand; the next call meets it again
                    ended.add(i)
                else:
                    results[i] = _joined(results[i], more)
        model_ms = (time.perf_counter() - started) * 1000
        batch = self._batch(passes)
        return [result if isinstance(result, RowError) else replace(result, model_ms=model_ms, batch=batch)
                for result in results]

    def _windows(self, requests: list[VerifyRequest], passes: list[PassRecord]) -> list[Verification | RowError]:
        """One forward pass over each call's window (its last token and drafts), and the rule;
        the pass's shape and time (with the rule's) appended to `passes`."""
        started = time.perf_counter()
        extensions = self.runner.extend_batch(
            [ExtendCall(r.seq_id, list(r.tokens) + list(r.draft_tokens), _logit_rows(r)) for r in requests])
        windows = [e.logits[-(len(r.draft_tokens) + 1):] for e, r in zip(extensions, requests)]   # [k+1, V] each
        outcomes = self._decide(requests, windows)
        results = [o if isinstance(o, RowError) else self._verification(r, o, e, w)
                   for r, o, e, w in zip(requests, outcomes, extensions, windows)]
        passes.append(_pass_record([(e.positions_fed, len(r.tokens) + len(r.draft_tokens))
                                    for e, r in zip(extensions, requests)], started))
        return results

    def _verification(self, request: VerifyRequest, outcome, extension: Extension,
                      window: torch.Tensor) -> Verification | RowError:
        """The round's outcome, with the logprobs it asked for from the rows the pass computed."""
        try:
            logprobs = prompt_logprobs = None
            if request.logprobs is not None:
                logprobs = tuple(token_logprobs(window[:len(outcome.tokens)], outcome.tokens, request.logprobs))
            if request.prompt_logprobs is not None:
                prompt_logprobs = tuple(token_logprobs(extension.logits[:len(request.tokens) - 1],
                                                       list(request.tokens[1:]), request.prompt_logprobs))
        except Exception as exc:  # noqa: BLE001 - this row alone fails
            return RowError.of(request.seq_id, exc)
        return Verification(outcome.accepted, outcome.tokens, extension.positions_fed, extension.batch_rows, 0.0,
                            extension.batch_positions, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _decide(self, requests: list[VerifyRequest], logits: list[torch.Tensor]) -> list:
        outcomes: list = [None] * len(requests)
        poisoned = torch.stack([row.isnan().any() for row in logits]).tolist()
        for i, bad in enumerate(poisoned):
            if bad:
                outcomes[i] = NonFiniteDistribution("the target model's logits hold NaN")
        # p of every position of the window, from the sequence's tokens up to it, drafts included
        logits = [adjusted_logits(rows, r.sampling, list(r.tokens) + list(r.draft_tokens), r.prompt_len, self.grammars)
                  for rows, r in zip(logits, requests)]
        greedy = [i for i, r in enumerate(requests) if r.sampling.greedy and outcomes[i] is None]
        for i, choices in zip(greedy, _argmax_rows([logits[i] for i in greedy])):
            outcomes[i] = greedy_round(choices, list(requests[i].draft_tokens))
        seeded = [i for i, r in enumerate(requests) if r.noise_seed is not None and outcomes[i] is None
                  and not r.sampling.greedy]
        for i in seeded:
            outcomes[i] = self._seeded_round(requests[i], logits[i])
        for i, request in enumerate(requests):
            if outcomes[i] is None and not _draft_probs_fit(request, logits[i].shape[-1]):
                outcomes[i] = ValueError(f"draft_probs of shape {tuple(request.draft_probs.shape)} for "
                                         f"{len(request.draft_tokens)} drafts over {logits[i].shape[-1]} tokens")
        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy and outcomes[i] is None]
        if sampled:
            device = logits[0].device
            for i, outcome in zip(sampled, self._sampled_rounds([requests[i] for i in sampled],
                                                                [logits[i] for i in sampled], device)):
                outcomes[i] = outcome
        return [self._row_result(request, outcome) for request, outcome in zip(requests, outcomes)]

    @staticmethod
    def _seeded_round(request: VerifyRequest, logits: torch.Tensor):
        """The target's Gumbel-max choice at each of the k + 1 positions (replicas/gumbel.py);
        drafts kept while they equal it. A row's failure is its outcome."""
        try:
            p = warped_probs(logits, request.sampling)                       # [k + 1, V]
            if not bool(sampleable(p).all()):
                return NonFiniteDistribution()
            choices = gumbel_choices(p, request.noise_seed, len(request.tokens)).tolist()
        except Exception as exc:  # noqa: BLE001 - this row alone fails
            return exc
        return greedy_round(choices, list(request.draft_tokens))

    @staticmethod
    def _sampled_rounds(requests: list[VerifyRequest], logits: list[torch.Tensor], device) -> list:
        try:
            return sampled_rounds(logits, [list(r.draft_tokens) for r in requests], [_dense(r.draft_probs, device)
                                                                                     for r in requests],
                                  [r.sampling for r in requests], [make_generator(r.seed, device) for r in requests])
        except Exception as exc:  # noqa: BLE001 - one row's bad input (its q, its params): find it alone
            if len(requests) == 1:
                return [exc]
            return [TargetEngine._sampled_rounds([r], [row], device)[0] for r, row in zip(requests, logits)]

    def _row_result(self, request: VerifyRequest, outcome):
        if isinstance(outcome, Exception):
            self.runner.release(request.seq_id)   # its cache may hold the same bad numbers
            return RowError.of(request.seq_id, outcome)
        return outcome


def _next_step(request: VerifyRequest, so_far: Verification, step: int) -> VerifyRequest:
    """The call's single-token step `step` (1, 2, ...): no drafts, on every token so far, with
    a seed of its own (a seeded request's noise is keyed by position, replicas/gumbel.py)."""
    digest = hashlib.blake2b(f"{request.seed}:{step}".encode(), digest_size=8).digest()
    return replace(request, tokens=list(request.tokens) + list(so_far.tokens), draft_tokens=[], draft_probs=None,
                   seed=int.from_bytes(digest, "little") >> 1, prompt_logprobs=None, steps=1)


def _joined(so_far: Verification, more: Verification) -> Verification:
    """A call's outcome with one more step's token (and its logprobs) after it."""
    logprobs = None if so_far.logprobs is None else so_far.logprobs + more.logprobs
    return replace(so_far, tokens=list(so_far.tokens) + list(more.tokens),
                   positions_fed=so_far.positions_fed + more.positions_fed, logprobs=logprobs)


def _logit_rows(request: VerifyRequest) -> int:
    """Rows of logits a verify needs: its window's k + 1, and the prompt's when it wants their logprobs."""
    window = len(request.draft_tokens) + 1
    return window + (len(request.tokens) - 1 if request.prompt_logprobs is not None else 0)


def _dense(q: TopProbs | torch.Tensor | None, device) -> torch.Tensor | None:
    """A draft's q [k, V] on the device: from the draft pool its top entries, or dense."""
    return q.dense(device) if isinstance(q, TopProbs) else q


def _draft_probs_fit(request: VerifyRequest, vocab: int) -> bool:
    q = request.draft_probs
    return q is None or tuple(q.shape) == (len(request.draft_tokens), vocab)


def _argmax_rows(logits: list[torch.Tensor]) -> list[list[int]]:
    """The argmax of every row of each [n, V] tensor, all in one transfer from the device."""
    if not logits:
        return []
    flat = torch.cat([rows.argmax(-1) for rows in logits]).tolist()
    out, start = [], 0
    for rows in logits:
        out.append(flat[start:start + rows.shape[0]])
        start += rows.shape[0]
    return out
