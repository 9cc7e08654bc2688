"""The per-request speculation loop: offer -> choose -> draft -> verify -> emit, one round at
a time.

A round's parts: the request's draft source makes its offer (router/draft_sources.py), the
goodput controller chooses the source, k and the verify call's steps (router/k_control.py),
drafts come from lookup or the draft pool, the target pool verifies them
(router/pool_client.py carries the calls), and the round's outcome is recorded once: in the
request's stats, the controller and the metrics. A round yields between 1 and k + steps
tokens. With speculation off a round verifies no drafts (k = 0), which is the target-only
baseline every comparison uses: same code, same caches.

Failures: the draft pool is optional (a round whose drafts fail or come late verifies
lookup drafts or none, router/fallback.py), the target pool is not (router/pool_client.py).
A RowError (this sequence's row failed on the replica) fails this sequence alone.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from replicas.protocol import (EngineStep, GenerateRequest, Proposal, ProposeRequest, RowError, TokenLogprobs,
                               Verification, VerifyRequest)
from replicas.sampling import SamplingParams
from router.draft_sources import DraftSources, fixed_source
from router.forced_drafts import FORCED, GrammarFollower
from router.fallback import DraftAvailability
from router.gathering import CallGatherer
from router.k_control import POOL, Choice, GoodputController, Offer
from router.lookahead import Drafts, lookahead_size, usable_drafts
from replicas.drafting.lookup import LookupOptions
from router.pool_client import PoolClient, PoolTimeouts
from router.readiness import PoolReadiness
from router.routing import lane_of
from replicas.drafting.suffix import OutputCache
from router.text import IncrementalDetokenizer, StopStringFilter

logger = logging.getLogger("ray.serve")
_KINDS = {POOL: "draft_model", "ngram": "ngram", "suffix": "suffix", FORCED: "forced"}   # a source's name in stats


@dataclass(frozen=True)
class Generation:
    """A validated request, in tokens."""
    prompt_ids: list[int]
    max_tokens: int            # already capped by the context length
    sampling: SamplingParams
    stop: list[str]
    seed: int
    k: int                     # draft tokens per round; 0 turns speculation off
    adaptive: bool = False     # k each round as the router's measured choice says (router/k_control.py)
    overlap: bool | str = False  # draft the next window while this one is verified (router/lookahead.py);
                                 # "auto": as the router's measured choice says (router/k_control.py)
    seeded: bool = False       # the client gave the seed: sampled by Gumbel-max (replicas/gumbel.py)
    stop_token_ids: tuple[int, ...] = ()   # end the output, as EOS does (the id is in the output)
    ignore_eos: bool = False   # EOS does not end the output: exactly max_tokens come
    include_stop: bool = False   # the stop string or stop token's text stays in the text
    skip_special_tokens: bool = True
    logprobs: int | None = None          # each token's logprob, with this many of the most likely
    prompt_logprobs: int | None = None   # the prompt's too (echo), from the first verify's rows
    echo: str | None = None              # the text a completion starts with (the prompt's, echoed)
    method: str = "draft_model"          # drafts from the draft pool, "ngram": prompt lookup (replicas/drafting/lookup.py),
                                         # "suffix": lookup in the sequence and recent outputs (replicas/drafting/suffix.py),
                                         # "hybrid": lookup where its match is long enough, else the pool

    def ends_on(self, eos_token_ids: set[int]) -> set[int]:
        """The token ids that end this output (once min_tokens are out)."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else eos_token_ids)


@dataclass
class RoundOutcome:
    """What one round did, recorded once (SpeculationStats.record, the controller, metrics)."""
    source: str | None          # where its verified drafts came from: POOL, "ngram", "suffix"; None: none
    context: int                # the sequence's tokens before the round
    k: int                      # drafts it asked for
    drafts: list[int]           # drafts it verified
    match: int                  # the lookup match its drafts came from (0: pool drafts or none)
    verdict: Verification
    proposal: Proposal | None   # the draft pool's answer, where this round called it
    ahead: Drafts | None        # drafts of an earlier lookahead this round used instead
    fallback: bool              # it wanted the pool's drafts and went on without them
    round_ms: float             # wall time at the router
    verify_call_ms: float       # the verify call's wall time at the router
    draft_call_ms: float = 0.0
    predicted_ms: float | None = None   # the controller's round time for it

    @property
    def kind(self) -> str | None:
        return _KINDS.get(self.source) if self.drafts else None

    @property
    def model_ms(self) -> float:
        """Engine time of the round's calls."""
        return self.verdict.model_ms + (self.proposal.model_ms if self.proposal is not None else 0.0)

    @property
    def busy_ms(self) -> float:
        """Time the round's replicas were busy with it or with other batches it queued behind:
        with more sequences than one batch holds, a round's wait for the engine is the other
        batches' engine time, which the controller must not price as the round's own overhead
        (it then thought drafts cheap next to it: k 3 at 32 clients, 0.85x the target alone,
        docs/BENCHMARKS.md)."""
        queued = self.verdict.queued_ms + (self.proposal.queued_ms if self.proposal is not None else 0.0)
        return self.model_ms + queued


@dataclass
class SpeculationStats:
    """Per-request counters. Model time is what the replicas spent in their batched engine
    calls; coordination is the rest of each round as the router saw it: handle hops,
    serialization, batch wait windows and queueing behind other batches."""
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_batch_rows: int = 0      # summed over rounds
    draft_batch_rows: float = 0.0   # summed over rounds that drafted
    draft_rounds: int = 0
    round_ms: float = 0.0           # summed wall time of rounds, at the router
    model_ms: float = 0.0           # summed draft + target engine time of those rounds
    retried_calls: int = 0          # calls repeated because their replica died
    fallback_rounds: int = 0        # rounds that wanted drafts and went on without them
    k_chosen: int = 0               # summed over rounds: the k each round asked for
    # Where coordination goes (summed): the calls' wall time at the router, and the part of
    # it the replicas spent on them (batch windows, queueing, the engine).
    call_ms: float = 0.0
    replica_ms: float = 0.0
    # Overlapped drafting (router/lookahead.py): lookaheads sent, rounds whose lookahead was
    # checked, those that used it, and draft engine time in all and the part of it hidden
    # behind verifies.
    lookaheads: int = 0
    lookaheads_checked: int = 0
    lookahead_hits: int = 0
    draft_ms: float = 0.0
    hidden_draft_ms: float = 0.0
    # Rounds that verified drafts, their drafts and those kept, by where the drafts came from.
    by_kind: dict[str, list[int]] = field(default_factory=dict)

    def record(self, outcome: RoundOutcome) -> None:
        verdict, proposal = outcome.verdict, outcome.proposal
        self.rounds += 1
        self.k_chosen += outcome.k
        self.drafted_tokens += len(outcome.drafts)
        self.accepted_tokens += verdict.accepted
        self.verify_batch_rows += verdict.batch_rows
        self.model_ms += outcome.model_ms
        self.round_ms += outcome.round_ms
        self.call_ms += outcome.verify_call_ms + outcome.draft_call_ms
        self.replica_ms += verdict.replica_ms + (proposal.replica_ms if proposal is not None else 0.0)
        self.fallback_rounds += outcome.fallback
        drafted_by = proposal or (outcome.ahead.proposal if outcome.ahead is not None else None)
        if drafted_by is not None:
            self.draft_rounds += 1
            self.draft_batch_rows += drafted_by.batch_rows
            self.draft_ms += drafted_by.model_ms
        if outcome.ahead is not None:
            self.hidden_draft_ms += outcome.ahead.proposal.model_ms
        if outcome.kind is not None:
            counts = self.by_kind.setdefault(outcome.kind, [0, 0, 0])
            counts[0] += 1
            counts[1] += len(outcome.drafts)
            counts[2] += verdict.accepted

    @classmethod
    def total(cls, parts: list["SpeculationStats"]) -> "SpeculationStats":
        """The counters of a request's choices, summed (its response reports them as one)."""
        total = cls(**{name: sum(getattr(part, name) for part in parts)
                       for name in cls.__dataclass_fields__ if name != "by_kind"})
        for part in parts:
            for kind, counts in part.by_kind.items():
                total.by_kind[kind] = [a + b for a, b in zip(total.by_kind.get(kind, [0, 0, 0]), counts)]
        return total

    def as_dict(self) -> dict:
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        per_round = 1 / self.rounds if self.rounds else 0.0
        return {"rounds": self.rounds, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": round(rate, 4),
                "mean_verify_batch": round(self.verify_batch_rows * per_round, 3),
                "mean_draft_batch": round(self.draft_batch_rows / self.draft_rounds, 3) if self.draft_rounds else 0.0,
                "round_ms": round(self.round_ms * per_round, 3),
                "coordination_ms_per_round": round((self.round_ms - self.model_ms) * per_round, 3),
                # coordination = hops (handle calls and router-side gathering: call wall time
                # outside the replicas) + replica waits (in a replica, outside the engine)
                # + router work between the calls
                "hop_ms_per_round": round((self.call_ms - self.replica_ms) * per_round, 3),
                "replica_wait_ms_per_round": round((self.replica_ms - self.model_ms) * per_round, 3),
                "router_ms_per_round": round((self.round_ms - self.call_ms) * per_round, 3),
                "retried_calls": self.retried_calls, "fallback_rounds": self.fallback_rounds,
                "mean_k": round(self.k_chosen * per_round, 3), "lookaheads": self.lookaheads,
                "lookahead_hit_rate": round(self.lookahead_hits / self.lookaheads_checked, 4)
                if self.lookaheads_checked else 0.0,
                "draft_hidden_share": round(self.hidden_draft_ms / self.draft_ms, 4) if self.draft_ms else 0.0,
                "forced_tokens": self.by_kind.get(_KINDS[FORCED], [0, 0, 0])[2],
                "by_kind": {kind: dict(zip(("rounds", "drafted_tokens", "accepted_tokens"),
                                           self.by_kind.get(kind, [0, 0, 0])))
                            for kind in _KINDS.values()}}


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop" or "length" on the last delta
    stop_reason: int | str | None = None   # vLLM's: the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None          # one per token id, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None   # on the first delta, when asked


@dataclass
class _Ahead:
    """A sequence's lookahead in flight: the call, the window it drafts after, and that
    window's verification."""
    task: asyncio.Task | None = None
    drafts: list[int] = field(default_factory=list)
    verdict: object = None

    def discard(self) -> None:
        self.task, self.drafts, self.verdict = None, [], None


@dataclass
class _Drafted:
    """A round's drafts as they came: their source, their q (pool drafts when sampling), the
    pool's proposal, the lookup match, whether the pool failed them, the draft call's ms."""
    source: str | None
    drafts: list[int]
    probs: object = None
    proposal: Proposal | None = None
    match: int = 0
    fell_back: bool = False
    call_ms: float = 0.0


@dataclass
class _Progress:
    text: IncrementalDetokenizer
    stops: StopStringFilter
    ends_on: set[int]               # EOS (unless ignored) and the request's stop token ids
    generated: list[int] = field(default_factory=list)


def round_seed(seed: int, round_index: int, role: str) -> int:
    """Independent, reproducible seeds per round and role, whichever replica serves them."""
    digest = hashlib.blake2b(f"{seed}:{round_index}:{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SpeculationLoop:
    def __init__(self, draft, target, tokenizer, eos_token_ids: set[int], timeouts: PoolTimeouts,
                 control: GoodputController, lanes: int = 1, gather_wait_s: float = 0.02, metrics=None,
                 channel_key: bytes | None = None, engine_rounds: bool = False,
                 lookup: LookupOptions | None = None, suffix_cache_tokens: int = 0):
        """engine_rounds: the target engine runs the rounds itself (vLLM, drafting from the
        draft pool on its own, replicas/engines/vllm/target.py): a request streams from it.
        control: the router's choice of every round's source, k and steps, for every method.
        lookup: how prompt lookup drafts (replicas/drafting/lookup.py) in hybrid and fallback rounds.
        suffix_cache_tokens: the finished outputs kept for suffix drafts (replicas/drafting/suffix.py)."""
        self.engine_rounds = engine_rounds
        self.client = PoolClient(draft, target, timeouts, channel_key)
        self.readiness = PoolReadiness(self.client.describe, list(self.client.pools))
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.lanes = lanes
        self.gatherer = CallGatherer(self.client.send, gather_wait_s,
                                     abandoned=lambda pool, lane, seq_id: self.client.release(lane, seq_id, pool))
        self.drafts = DraftAvailability(self._probe_drafts, timeouts.draft_s)
        self.control = control
        self.outputs = OutputCache(suffix_cache_tokens) if suffix_cache_tokens else None
        self.sources = DraftSources(lookup or LookupOptions(), self.outputs)
        self.metrics = metrics            # router/metrics.py RouterMetrics, or None
        self._anchors_task: asyncio.Task | None = None
        self._anchored: set[str] = set()  # pools whose start-up passes the controller has
        self._running: set[str] = set()
        # sequences that called the draft pool: only their caches there need releasing (a
        # release is a handle call, about as much of the router's time as a round's choice)
        self._on_draft_pool: set[str] = set()

    @property
    def call_paths(self):
        return self.client.call_paths

    def active_sequences(self) -> list[str]:
        return sorted(self._running)

    async def run(self, gen: Generation, stats: SpeculationStats, seq_id: str | None = None) -> AsyncIterator[Delta]:
        seq_id = seq_id or uuid.uuid4().hex
        lane = lane_of(seq_id, self.lanes)
        tokens = list(gen.prompt_ids)
        progress = _Progress(IncrementalDetokenizer(self.tokenizer, skip_special_tokens=gen.skip_special_tokens),
                             StopStringFilter(gen.stop, keep=gen.include_stop), gen.ends_on(self.eos_token_ids))
        self.gatherer.begin(lane, seq_id)
        self._running.add(seq_id)
        self.control.begin(seq_id, sampled=not gen.sampling.greedy)
        ahead = _Ahead()
        # A constrained, speculating sequence: the grammar drafts what it forces (router/forced_drafts.py)
        grammar = (GrammarFollower(self.tokenizer, gen.sampling.grammar)
                   if gen.sampling.grammar is not None and gen.k > 0 and not self.engine_rounds else None)
        chunks = (self._engine_rounds(seq_id, gen, stats) if self.engine_rounds
                  else self._rounds(lane, seq_id, tokens, gen, stats, ahead, grammar))
        try:
            async for new_tokens, verdict in chunks:
                delta = self._emit(new_tokens, progress, gen, verdict)
                tokens.extend(delta.token_ids)
                if grammar is not None:
                    grammar.advance(delta.token_ids)
                yield delta
                if delta.finish_reason:
                    return
            # The engine ended the request on a stop token of its own.
            progress.stops.add(progress.text.flush())
            yield Delta(progress.stops.release(final=True), [], "stop")
        finally:
            # Nothing awaited before the caches are released: a request cancelled again while
            # it unwinds must not leave them held.
            self._running.discard(seq_id)
            self.control.end(seq_id)
            self.gatherer.finish(lane, seq_id)
            self.client.retries.pop(seq_id, None)
            self.client.release(lane, seq_id, *(("draft", "target") if seq_id in self._on_draft_pool else ("target",)))
            self._on_draft_pool.discard(seq_id)
            if self.outputs is not None and not self.engine_rounds:
                self.outputs.add(gen.prompt_ids, tokens[len(gen.prompt_ids):])
            if ahead.task is not None:   # it would cache the sequence again on the draft replica
                ahead.task.add_done_callback(lambda _: self.client.release(lane, seq_id, "draft"))
            await chunks.aclose()        # an engine's stream: abort the request there now

    async def _rounds(self, lane: str, seq_id: str, tokens: list[int], gen: Generation, stats: SpeculationStats,
                      ahead: _Ahead, grammar: GrammarFollower | None) -> AsyncIterator[tuple[list[int], Verification]]:
        while True:
            verdict = await self._round(lane, seq_id, tokens, gen, stats, ahead, grammar)
            yield verdict.tokens, verdict

    async def _engine_rounds(self, seq_id: str, gen: Generation,
                             stats: SpeculationStats) -> AsyncIterator[tuple[list[int], EngineStep]]:
        """The target engine's stream of steps (each: its accepted drafts and its own token,
        with their logprobs if asked); a step late by more than the target's call timeout
        fails the request. Leaving early aborts the request there."""
        request = GenerateRequest(seq_id, list(gen.prompt_ids), gen.max_tokens, gen.sampling, gen.seed,
                                  tuple(sorted(gen.ends_on(self.eos_token_ids))), gen.ignore_eos,
                                  logprobs=gen.logprobs, prompt_logprobs=gen.prompt_logprobs)
        response = self.client.pools["target"].options(stream=True).generate.remote(request)
        try:
            while True:
                started = time.perf_counter()
                try:
                    step = await asyncio.wait_for(response.__anext__(), self.client.timeouts.target_s)
                except StopAsyncIteration:
                    return
                stats.rounds += 1
                stats.round_ms += (time.perf_counter() - started) * 1000
                yield step.tokens, step
        finally:
            response.cancel()

    async def _round(self, lane: str, seq_id: str, tokens: list[int], gen: Generation,
                     stats: SpeculationStats, ahead: _Ahead, grammar: GrammarFollower | None) -> Verification:
        started = time.perf_counter()
        cap = gen.max_tokens - (len(tokens) - len(gen.prompt_ids)) - 1   # a round yields up to k + steps tokens
        if cap == 0 and seq_id in self._on_draft_pool:
            # The last token needs no draft: free the draft pool's cache now.
            self.client.release(lane, seq_id, "draft")
        self._anchor_costs()
        forced = grammar.forced(cap) if grammar is not None else []
        if forced:   # certain drafts, made here: no choice to make, no draft call
            choice, offer = Choice(FORCED, len(forced), 1, None), Offer()
        else:
            choice, offer = self._choose(seq_id, tokens, gen, cap)
        overlap = self._overlap(seq_id, gen, choice)
        ready = await self._drafts_ahead(ahead, choice.k if choice.source == POOL else 0, stats)
        if forced:
            drafted = _Drafted(FORCED, forced)
        elif ready is not None:   # drafted off this round's path
            drafted = _Drafted(POOL, ready.tokens, ready.probs)
        else:
            drafted = await self._draft(lane, seq_id, tokens, gen, choice, offer, stats.rounds)
            if grammar is not None and drafted.source != POOL:   # lookup drafts past the grammar: cut
                drafted.drafts = grammar.allowed_prefix(drafted.drafts)
        drafts = drafted.drafts
        # The first round's one pass: its token is not held back by further steps.
        steps = 1 if stats.rounds == 0 or (overlap and drafts) else choice.steps
        verify_started = time.perf_counter()
        verifying = asyncio.ensure_future(self.gatherer.call("target", lane, seq_id, VerifyRequest(
            seq_id, tokens, drafts, drafted.probs, gen.sampling, round_seed(gen.seed, stats.rounds, "target"),
            noise_seed=self._noise_seed(gen), prompt_len=len(gen.prompt_ids), logprobs=gen.logprobs,
            prompt_logprobs=gen.prompt_logprobs if stats.rounds == 0 else None,
            steps=steps, stop_ids=tuple(gen.ends_on(self.eos_token_ids)),
            engine_drafts=gen.k > 0 and gen.sampling.grammar is None)))
        if overlap and drafts and drafted.source == POOL:
            stats.lookaheads += self._look_ahead(ahead, lane, seq_id, tokens, drafts,
                                                 lookahead_size(choice.k, cap - len(drafts) - 1), gen, stats.rounds)
        verdict = await verifying
        ahead.verdict = verdict
        now = time.perf_counter()
        self._record(seq_id, stats, RoundOutcome(
            drafted.source, len(tokens), choice.k, drafts, drafted.match, verdict, drafted.proposal, ready,
            drafted.fell_back or offer.fallback, (now - started) * 1000, (now - verify_started) * 1000,
            drafted.call_ms, choice.predicted_ms))
        return verdict

    def _choose(self, seq_id: str, tokens: list[int], gen: Generation, cap: int) -> tuple[Choice, Offer]:
        """This round's source, k and steps: the controller's choice (router/k_control.py), or
        the request's fixed k from its method's source."""
        pool = self.client.has("draft") and self.drafts.available and self.readiness.is_ready("draft")
        if not gen.adaptive:
            k = min(gen.k, max(cap, 0))
            offer = self.sources.offer(gen.method, tokens, k, pool)
            source = fixed_source(offer) if k else None
            if source is not None and source != POOL:
                k = min(k, len(offer.lookup))
            return Choice(source, k if source else 0, self.control.steps(k if source else 0, cap), None), offer
        offer = self.sources.offer(gen.method, tokens, min(self.control.max_k, max(cap, 0)), pool,
                                   may=lambda source: self.control.may_draft(seq_id, source, len(tokens)))
        return self.control.choose(seq_id, offer, len(tokens), cap, gen.method), offer

    def _overlap(self, seq_id: str, gen: Generation, choice: Choice) -> bool:
        """Whether this round drafts the next window while it is verified (router/lookahead.py)."""
        if choice.source != POOL or choice.k == 0:
            return False
        return self.control.overlap_pays(seq_id, choice.k) if gen.overlap == "auto" else bool(gen.overlap)

    def _record(self, seq_id: str, stats: SpeculationStats, outcome: RoundOutcome) -> None:
        """The round's outcome, once: the request's stats, the controller, the metrics."""
        verdict, proposal = outcome.verdict, outcome.proposal
        if self.metrics is not None:
            # A call after the first that computed the whole sequence again rebuilt its cache.
            rebuilt = {"target": stats.rounds > 0 and verdict.positions_fed >= outcome.context,
                       "draft": stats.rounds > 0 and proposal is not None and proposal.positions_fed >= outcome.context}
            self.metrics.round(outcome, rebuilt)
        stats.record(outcome)
        stats.retried_calls = self.client.retries[seq_id]
        control = self.control
        if outcome.source != FORCED:   # forced drafts are kept for certain: no evidence of any source's
            control.observe_round(seq_id, outcome.source if outcome.drafts else None, len(outcome.drafts),
                                  verdict.accepted, outcome.match)
        if verdict.batch is not None:
            control.observe_passes("target", verdict.batch.batch_id, verdict.batch.passes)
        if proposal is not None and proposal.batch is not None:
            control.observe_passes("draft", proposal.batch.batch_id, proposal.batch.passes)
        control.observe_timing(proposal is not None, outcome.round_ms, outcome.busy_ms, outcome.predicted_ms)

    def _anchor_costs(self) -> None:
        """The pools' start-up passes, once each, fetched in the background (a fresh context:
        it outlives the request that asked): the controller's cost model starts from them."""
        if len(self._anchored) == len(self.client.pools):
            return
        if self._anchors_task is None or self._anchors_task.done():
            self._anchors_task = asyncio.get_running_loop().create_task(
                self._fetch_anchors(), context=contextvars.Context())

    async def _fetch_anchors(self) -> None:
        for pool in self.client.pools:
            if pool in self._anchored:
                continue
            try:
                state = await self.client.describe(pool, 30.0)
            except Exception:  # noqa: BLE001 - asked again at a later round; the generic anchor meanwhile
                logger.warning("no start-up passes from the %s pool yet", pool, exc_info=True)
                continue
            self.control.anchor(pool, state.get("startup_passes") or [])
            self._anchored.add(pool)

    @staticmethod
    def _noise_seed(gen: Generation) -> int | None:
        """The seed of a seeded sampled request's public noise (replicas/gumbel.py)."""
        return gen.seed if gen.seeded and not gen.sampling.greedy else None

    async def _draft(self, lane: str, seq_id: str, tokens: list[int], gen: Generation, choice: Choice,
                     offer: Offer, round_index: int) -> _Drafted:
        """The chosen drafts. Lookup drafts go without q: one-hot, as the target's rule then
        takes them. A pool call that fails or comes late: prompt lookup instead, or none."""
        if choice.k == 0 or choice.source is None:
            return _Drafted(None, [])
        if choice.source != POOL:
            return _Drafted(choice.source, list(offer.lookup[:choice.k]), match=offer.match)
        started = time.perf_counter()
        try:
            self._on_draft_pool.add(seq_id)
            proposal = await self.gatherer.call("draft", lane, seq_id, ProposeRequest(
                seq_id, tokens, choice.k, gen.sampling, round_seed(gen.seed, round_index, "draft"),
                noise_seed=self._noise_seed(gen), prompt_len=len(gen.prompt_ids)))
        except RowError as exc:   # this sequence's row alone failed on the draft replica
            logger.warning("drafting failed for %s (%s): verifying without the pool's drafts", seq_id, exc)
            return self._fell_back(tokens, choice.k)
        except Exception as exc:  # noqa: BLE001 - the pool failed or is late: go on without it
            self.drafts.report_failure(type(exc).__name__)
            return self._fell_back(tokens, choice.k)
        return _Drafted(POOL, proposal.tokens, proposal.probs, proposal, call_ms=(time.perf_counter() - started) * 1000)

    def _fell_back(self, tokens: list[int], k: int) -> _Drafted:
        drafts, match = self.sources.fallback(tokens, k)
        return _Drafted("ngram" if drafts else None, drafts, match=match, fell_back=True)

    async def _drafts_ahead(self, ahead: _Ahead, k: int, stats: SpeculationStats) -> Drafts | None:
        """This round's drafts from the last round's lookahead, when its guess held. A
        lookahead is awaited even when it cannot hold (the draft replica runs it before the
        next propose anyway): so the draft replica's cache sees the same calls in the same
        order every time, and a seed gives the same sample (logits computed over a cached
        prefix differ in the last bits from logits computed afresh)."""
        task, drafts, verdict = ahead.task, ahead.drafts, ahead.verdict
        if task is None:
            return None
        stats.lookaheads_checked += 1
        # Shielded, and forgotten only once done: a request cancelled meanwhile leaves the
        # lookahead to finish, and its cleanup frees the draft cache after it (in `run`).
        lookahead = await asyncio.shield(task)
        ahead.discard()
        if k == 0 or lookahead is None:
            return None
        ready = usable_drafts(drafts, verdict, lookahead, k)
        if ready is None or not ready.tokens:
            return None
        stats.lookahead_hits += 1
        return ready

    def _look_ahead(self, ahead: _Ahead, lane: str, seq_id: str, tokens: list[int], drafts: list[int],
                    size: int, gen: Generation, round_index: int) -> int:
        """Ask the draft pool for the guess and `size` drafts after this window, while it is
        verified; outside the lane's gathering (the sequence has a call in flight already).
        Returns the lookaheads sent (0 or 1)."""
        if size == 0:
            return 0
        request = ProposeRequest(seq_id, tokens + drafts, size + 1, gen.sampling,
                                 round_seed(gen.seed, round_index, "draft-ahead"), lookahead=True,
                                 noise_seed=self._noise_seed(gen), prompt_len=len(gen.prompt_ids))

        self._on_draft_pool.add(seq_id)

        async def look() -> Proposal | None:
            try:
                [answer] = await self.client.send("draft", lane, [request])
            except Exception:  # noqa: BLE001 - a lost lookahead is a miss; the next round drafts
                return None
            return None if isinstance(answer, RowError) else answer
        ahead.task = asyncio.get_running_loop().create_task(look())
        ahead.drafts = list(drafts)
        return 1

    async def _probe_drafts(self) -> None:
        await self.client.describe("draft", self.client.timeouts.draft_s)

    @staticmethod
    def _emit(new_tokens: list[int], progress: _Progress, gen: Generation,
              verdict: Verification | EngineStep | None) -> Delta:
        """Take the round's tokens one at a time until a stop token (EOS unless ignored, the
        request's stop ids; its text left out unless include_stop), a stop string or
        max_tokens. Before min_tokens are out nothing stops it (as in vLLM; the engines mask
        the stop ids' logits until then, replicas/logits_processing.py)."""
        delta = Delta("", [])
        for token in new_tokens:
            progress.generated.append(token)
            delta.token_ids.append(token)
            may_stop = len(progress.generated) >= gen.sampling.min_tokens
            if may_stop and token in progress.ends_on:
                if gen.include_stop:
                    progress.stops.add(progress.text.push(token), check=False)
                delta.finish_reason = "stop"
                delta.stop_reason = token if token in gen.stop_token_ids else None
            else:
                progress.stops.add(progress.text.push(token), check=may_stop)
                if progress.stops.stopped:
                    delta.finish_reason, delta.stop_reason = "stop", progress.stops.hit
                elif len(progress.generated) >= gen.max_tokens:
                    delta.finish_reason = "length"
            if delta.finish_reason:
                if not progress.stops.stopped:
                    progress.stops.add(progress.text.flush(), check=False)
                break
        delta.text = progress.stops.release(final=delta.finish_reason is not None)
        if verdict is not None and verdict.logprobs is not None:
            delta.logprobs = list(verdict.logprobs[:len(delta.token_ids)])
        if verdict is not None and verdict.prompt_logprobs is not None:
            delta.prompt_logprobs = list(verdict.prompt_logprobs)
        return delta
