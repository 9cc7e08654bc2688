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

from replicas.device_reads import DeviceReads
from replicas.drafting.lookup import lookup_drafts
from replicas.draft_probs import DEFAULT_TOP, TopProbs, cut_to_top
from replicas.engines.huggingface.kv_cache import KVCacheStore
from replicas.grammar import GrammarMasks
from replicas.logits_processing import adjusted_logits
from replicas.logprobs import token_logprobs
from replicas.engines.huggingface.model_runner import ExtendCall, Extension, ModelRunner
from replicas.engines.huggingface.timing import startup_passes
from replicas.protocol import BatchCost, PassRecord, Proposal, ProposeRequest, RowError, Verification, VerifyRequest
from replicas.gumbel import gumbel_choices
from replicas.sampling import NonFiniteDistribution, make_generator, sampleable, warped_probs
from replicas.speculative import greedy_round, sampled_decisions, sampled_outcomes


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
        self.engine_drafts = {"sent": 0, "kept": 0}   # the target's own drafts (TargetEngine._with_engine_draft)
        self.grammars = grammars   # a request's grammar as masks (None: a folder without a tokenizer)
        self._batch_ids = (f"{uuid.uuid4().hex[:8]}-{n}" for n in itertools.count())

    @classmethod
    def on_model(cls, model: PreTrainedModel, max_cached_tokens: int, max_seq_len: int | None = None,
                 compiled: bool = False, fused_cpu: bool = False, grammars: GrammarMasks | None = None,
                 probs_top: int = DEFAULT_TOP, row_block: int | None = None, cuda_graphs: bool = False):
        """The engine over one in-process model (tests, offline measurement)."""
        return cls(ModelRunner(model, max_cached_tokens, max_seq_len, compiled=compiled, fused_cpu=fused_cpu,
                               row_block=row_block, cuda_graphs=cuda_graphs), grammars, probs_top)

    def release(self, seq_id: str) -> None:
        """The sequence has finished (the router says so)."""
        self.runner.retire(seq_id)

    def describe(self) -> dict:
        caches = self.runner.caches
        shards = getattr(self.runner, "shards", None)
        return {"engine": "huggingface", "tp_size": len(shards) if shards else 1,
                "compile_s": getattr(self.runner, "compile_s", None), "dtype": _dtype_name(self.runner),
                "fused_cpu": getattr(self.runner, "fused", False),
                "cuda_graphs": getattr(self.runner, "graph_counts", None),
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
        probs = TopProbs.of_calls(rows, self.probs_top)
        return [failures.get(i) or Proposal(drafts[i], probs[i], fed[i], mean_rows, model_ms, steps=len(batch_rows),
                                            batch=batch)
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
        for a greedy row; for a seeded request the Gumbel-max choice from q at its position;
        a sample from q for the others (q kept for the target's rule). Chosen on the device
        and read in one transfer (replicas/device_reads.py), with whether each q was finite."""
        reads, picked = DeviceReads(), {}
        for i, extension, history in zip(active, extensions, histories):
            request = requests[i]
            try:
                logits = adjusted_logits(extension.logits, self._draft_sampling(request.sampling), history,
                                         request.prompt_len, self.grammars)[0]          # [V]
                if request.sampling.greedy:
                    picked[i] = reads.add(logits.argmax(-1))
                    continue
                q = warped_probs(logits[None], request.sampling)[0]                     # [V]
                finite = sampleable(q)
                if request.noise_seed is not None:
                    choice = gumbel_choices(q[None], request.noise_seed, len(history))[0]
                else:
                    q = cut_to_top(q, self.probs_top)              # what is sampled is what is sent
                    # (a q that is not finite fails its row below; multinomial must not see it)
                    choice = torch.multinomial(torch.where(finite, q, torch.ones_like(q)), 1,
                                               generator=generators[i])[0]
                    rows[i].append(q)
                picked[i] = reads.add(torch.stack([choice, ~finite]))
            except Exception as exc:  # noqa: BLE001 - this row alone fails
                failures[i] = RowError.of(request.seq_id, exc)
        values = reads.read()
        chosen = {}
        for i, handle in picked.items():
            choice, *broken = values[handle]
            if any(broken):
                failures[i] = RowError.of(requests[i].seq_id, NonFiniteDistribution())
            else:
                chosen[i] = choice
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
                     and isinstance(v, Verification) and not set(v.tokens) & set(r.stop_ids)]
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
        requests, own_draft = self._with_engine_draft(requests)
        extensions = self.runner.extend_batch(
            [ExtendCall(r.seq_id, list(r.tokens) + list(r.draft_tokens), _logit_rows(r)) for r in requests])
        windows = [e.logits[-(len(r.draft_tokens) + 1):] for e, r in zip(extensions, requests)]   # [k+1, V] each
        outcomes = self._decide(requests, windows)
        results = [o if isinstance(o, RowError) else self._verification(r, o, e, w)
                   for r, o, e, w in zip(requests, outcomes, extensions, windows)]
        if own_draft and isinstance(results[0], Verification):   # `accepted` counts the router's drafts only
            self.engine_drafts["sent"] += 1
            self.engine_drafts["kept"] += results[0].accepted
            results[0] = replace(results[0], accepted=0)
        passes.append(_pass_record([(e.positions_fed, len(r.tokens) + len(r.draft_tokens))
                                    for e, r in zip(extensions, requests)], started))
        return results

    def _with_engine_draft(self, requests: list[VerifyRequest]) -> tuple[list[VerifyRequest], bool]:
        """A lone call without drafts, on a runner that computes a lone position as a window of
        two anyway (llama.cpp's `lone_step_window`, runner.py), takes one draft of the
        engine's own in that window's second place: prompt lookup over the sequence's tokens
        (replicas/drafting/lookup.py). The pass costs what it would have, and the rule verifies
        the draft as it verifies any lookup draft (one-hot q: greedy keeps it where it is the
        argmax, sampling where the rule accepts it), so an accepted draft is a token for
        nothing and the output is exactly the target's. Only for calls that allow it
        (VerifyRequest.engine_drafts: the request speculates) and have room for the position.
        Returns the calls and whether the lone one carries such a draft."""
        if len(requests) != 1 or not getattr(self.runner, "lone_step_window", False):
            return requests, False
        [request] = requests
        if (not request.engine_drafts or request.draft_tokens or request.prompt_logprobs is not None
                or len(request.tokens) >= self.runner.max_seq_len):
            return requests, False
        drafts = lookup_drafts(list(request.tokens), 1)
        if not drafts:
            return requests, False
        return [replace(request, draft_tokens=drafts, draft_probs=None)], True

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
        """Every row's outcome, decided on the device and read to the host in one transfer
        (replicas/device_reads.py): whether its logits hold NaN, then greedy rows' argmaxes,
        seeded rows' Gumbel-max choices and sampled rows' rule. A row's error is its outcome."""
        reads = DeviceReads()
        poisoned = reads.add(torch.stack([row.isnan().any() for row in logits]))
        # p of every position of the window, from the sequence's tokens up to it, drafts included
        logits = [adjusted_logits(rows, r.sampling, list(r.tokens) + list(r.draft_tokens), r.prompt_len, self.grammars)
                  for rows, r in zip(logits, requests)]
        pending: list = [None] * len(requests)    # a handle into reads, or the row's error
        greedy = [i for i, r in enumerate(requests) if r.sampling.greedy]
        if greedy:
            argmaxes = reads.add(torch.cat([logits[i].argmax(-1) for i in greedy]))
        for i, request in enumerate(requests):
            if request.noise_seed is not None and not request.sampling.greedy:
                pending[i] = self._seeded_choices(request, logits[i], reads)
            elif not request.sampling.greedy and not _draft_probs_fit(request, logits[i].shape[-1]):
                pending[i] = ValueError(f"draft_probs of shape {tuple(request.draft_probs.shape)} for "
                                        f"{len(request.draft_tokens)} drafts over {logits[i].shape[-1]} tokens")
        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy and pending[i] is None]
        if sampled:
            for i, decided in zip(sampled, self._sampled_decisions([requests[i] for i in sampled],
                                                                   [logits[i] for i in sampled], logits[0].device)):
                pending[i] = decided if isinstance(decided, Exception) else reads.add(decided)
        values = reads.read()
        outcomes: list = [None] * len(requests)
        if greedy:
            at = 0
            for i in greedy:
                window = len(requests[i].draft_tokens) + 1
                outcomes[i] = greedy_round(values[argmaxes][at:at + window], list(requests[i].draft_tokens))
                at += window
        for i, request in enumerate(requests):
            if values[poisoned][i]:
                outcomes[i] = NonFiniteDistribution("the target model's logits hold NaN")
            elif isinstance(pending[i], Exception):
                outcomes[i] = pending[i]
            elif request.noise_seed is not None and not request.sampling.greedy:
                broken, *choices = values[pending[i]]
                outcomes[i] = NonFiniteDistribution() if broken else greedy_round(choices, list(request.draft_tokens))
            elif i in sampled:
                outcomes[i] = sampled_outcomes([[value] for value in values[pending[i]]], [list(request.draft_tokens)])[0]
        return [self._row_result(request, outcome) for request, outcome in zip(requests, outcomes)]

    @staticmethod
    def _seeded_choices(request: VerifyRequest, logits: torch.Tensor, reads: DeviceReads) -> int | Exception:
        """The target's Gumbel-max choice at each of the k + 1 positions (replicas/gumbel.py),
        after a flag of whether p is finite; drafts are kept while they equal it. Returns the
        handle of [flag, choices...] in reads, or the row's error."""
        try:
            p = warped_probs(logits, request.sampling)                       # [k + 1, V]
            choices = gumbel_choices(p, request.noise_seed, len(request.tokens))
            return reads.add(torch.cat([(~sampleable(p).all())[None], choices]))
        except Exception as exc:  # noqa: BLE001 - this row alone fails
            return exc

    @staticmethod
    def _sampled_decisions(requests: list[VerifyRequest], logits: list[torch.Tensor], device) -> list:
        """Each row's [3] decisions on the device (replicas/speculative.py sampled_decisions),
        or its error."""
        try:
            decided = sampled_decisions(logits, [list(r.draft_tokens) for r in requests],
                                        [_dense(r.draft_probs, device) for r in requests],
                                        [r.sampling for r in requests], [make_generator(r.seed, device) for r in requests])
            return [decided[:, b] for b in range(len(requests))]
        except Exception as exc:  # noqa: BLE001 - one row's bad input (its q, its params): find it alone
            if len(requests) == 1:
                return [exc]
            return [TargetEngine._sampled_decisions([r], [row], device)[0] for r, row in zip(requests, logits)]

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
