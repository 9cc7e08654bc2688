"""The per-request speculation loop: draft -> verify -> emit, one round at a time.

A round asks the draft pool for k tokens and the target pool to verify them; it yields
between 1 and k + 1 tokens. With speculation off a round is one plain target step (k = 0),
which is the target-only baseline every comparison uses: same code, same caches.

Failures: the draft pool is optional (a round whose drafts fail or come late verifies with
k = 0, router/fallback.py), the target pool is not. A verify call whose replica died is
retried on another replica; one that is not answered within the pool's timeout fails its
sequences with TargetTimeout; a RowError (this sequence's row failed on the replica) fails
this sequence alone.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import itertools
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from replicas.direct_channel import ChannelBroken
from replicas.protocol import (EngineStep, GenerateRequest, Proposal, ProposeRequest, RowError, TokenLogprobs,
                               Verification, VerifyRequest)
from replicas.sampling import SamplingParams
from router.fallback import DraftAvailability
from router.direct_routes import DirectRoutes
from router.gathering import CallGatherer
from router.goodput import CostProfile
from router.k_control import Arm, KController
from router.lookahead import Drafts, lookahead_size, usable_drafts
from router.lookup import LookupOptions, lookup_drafts, lookup_match
from router.suffix import OutputCache, suffix_drafts
from router.routing import lane_of
from router.text import IncrementalDetokenizer, StopStringFilter

logger = logging.getLogger("ray.serve")
# A call whose replica died is retried until Serve has noticed and routes elsewhere, or has
# replaced the replica (seconds; a tensor-parallel replica restarts all its shards).
_RETRY_BACKOFF_S = 0.1
_LONGEST_RETRY_PAUSE_S = 2.0
_METHODS = {"draft": "propose", "target": "verify"}


class TargetTimeout(Exception):
    """A verify call was not answered within the target pool's call timeout."""


class TargetUnavailable(Exception):
    """Every attempt of a verify call found its replica dead."""


@dataclass(frozen=True)
class PoolTimeouts:
    draft_s: float             # the draft budget: later drafts are not waited for
    target_s: float


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
    method: str = "draft_model"          # drafts from the draft pool, "ngram": prompt lookup (router/lookup.py),
                                         # "suffix": lookup in the sequence and recent outputs (router/suffix.py),
                                         # "hybrid": lookup where its match is long enough, else the pool

    def ends_on(self, eos_token_ids: set[int]) -> set[int]:
        """The token ids that end this output (once min_tokens are out)."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else eos_token_ids)


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
    # Rounds whose drafts came from prompt lookup (router/lookup.py), their drafts and those kept;
    # the same for suffix drafts (router/suffix.py).
    lookup_rounds: int = 0
    lookup_drafted_tokens: int = 0
    lookup_accepted_tokens: int = 0
    suffix_rounds: int = 0
    suffix_drafted_tokens: int = 0
    suffix_accepted_tokens: int = 0

    @classmethod
    def total(cls, parts: list["SpeculationStats"]) -> "SpeculationStats":
        """The counters of a request's choices, summed (its response reports them as one)."""
        return cls(**{name: sum(getattr(part, name) for part in parts) for name in cls.__dataclass_fields__})

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
                "by_kind": self._by_kind()}

    def _by_kind(self) -> dict:
        """Rounds that drafted, drafts and accepted drafts, by where the drafts came from."""
        return {"draft_model": {"rounds": self.draft_rounds,
                                "drafted_tokens": self.drafted_tokens - self.lookup_drafted_tokens
                                - self.suffix_drafted_tokens,
                                "accepted_tokens": self.accepted_tokens - self.lookup_accepted_tokens
                                - self.suffix_accepted_tokens},
                "ngram": {"rounds": self.lookup_rounds, "drafted_tokens": self.lookup_drafted_tokens,
                          "accepted_tokens": self.lookup_accepted_tokens},
                "suffix": {"rounds": self.suffix_rounds, "drafted_tokens": self.suffix_drafted_tokens,
                           "accepted_tokens": self.suffix_accepted_tokens}}


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
                 control: KController, lanes: int = 1, gather_wait_s: float = 0.02, metrics=None,
                 channel_key: bytes | None = None, engine_rounds: bool = False, decode_steps: int = 1,
                 lookup: LookupOptions | None = None, suffix_cache_tokens: int = 0):
        """engine_rounds: the target engine runs the rounds itself (vLLM, drafting from the
        draft pool on its own, replicas/engines/vllm/target.py): a request streams from it.
        decode_steps: single-token steps one target call runs for a round without drafts.
        lookup: how prompt lookup drafts (router/lookup.py) in hybrid and fallback rounds.
        control: the measured choice of k for the draft pool's drafts; lookup requests' have
        one per method, with the same bounds (their keep chances and best k differ: a lookup
        draft costs no draft call).
        suffix_cache_tokens: the finished outputs kept for suffix drafts (router/suffix.py)."""
        self.engine_rounds = engine_rounds
        self.decode_steps = decode_steps
        self.lookup = lookup or LookupOptions()
        # DeploymentHandles of the pools, by value: a call goes to the replica directly
        # instead of through the object store, 4.96 -> 3.75 ms median per call here
        # (python -m cluster.bench.hops, docs/BENCHMARKS.md).
        # No draft pool (draft None): the cluster drafts by lookup only.
        self.pools = {pool: handle.options(_by_reference=False)
                      for pool, handle in (("draft", draft), ("target", target)) if handle is not None}
        # Faster still: the calls of a round over direct channels to the same replicas (about
        # 0.75 ms against 4.3-4.8 ms a handle call, docs/BENCHMARKS.md); handles carry the rest.
        self.routes = DirectRoutes(channel_key, self._channel_address) if channel_key is not None else None
        self.call_paths: Counter[str] = Counter()   # pool calls sent "direct" and by "handle"
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.timeouts = timeouts
        self.lanes = lanes
        self.gatherer = CallGatherer(self._send, gather_wait_s,
                                     abandoned=lambda pool, lane, seq_id: self._release(lane, seq_id, pool))
        self.drafts = DraftAvailability(self._probe_drafts, timeouts.draft_s)
        self.control = control
        self.lookup_controls = {method: KController(control.min_k, control.max_k, control.start.k,
                                                    hybrid=method == "hybrid")
                                for method in ("ngram", "suffix", "hybrid")}
        self.outputs = OutputCache(suffix_cache_tokens) if suffix_cache_tokens else None
        self.metrics = metrics            # router/metrics.py RouterMetrics, or None
        self._profiles_task: asyncio.Task | None = None
        self._retries: Counter[str] = Counter()   # per sequence: calls repeated after a replica died
        self._running: set[str] = set()

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
        ahead = _Ahead()
        chunks = (self._engine_rounds(seq_id, gen, stats) if self.engine_rounds
                  else self._rounds(lane, seq_id, tokens, gen, stats, ahead))
        try:
            async for new_tokens, verdict in chunks:
                delta = self._emit(new_tokens, progress, gen, verdict)
                tokens.extend(delta.token_ids)
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
            self.gatherer.finish(lane, seq_id)
            self._retries.pop(seq_id, None)
            self._release(lane, seq_id, "draft", "target")
            if self.outputs is not None and not self.engine_rounds:
                self.outputs.add(gen.prompt_ids, tokens[len(gen.prompt_ids):])
            if ahead.task is not None:   # it would cache the sequence again on the draft replica
                ahead.task.add_done_callback(lambda _: self._release(lane, seq_id, "draft"))
            await chunks.aclose()        # an engine's stream: abort the request there now

    async def _rounds(self, lane: str, seq_id: str, tokens: list[int], gen: Generation,
                      stats: SpeculationStats, ahead: _Ahead) -> AsyncIterator[tuple[list[int], Verification]]:
        while True:
            verdict = await self._round(lane, seq_id, tokens, gen, stats, ahead)
            yield verdict.tokens, verdict

    async def _engine_rounds(self, seq_id: str, gen: Generation,
                             stats: SpeculationStats) -> AsyncIterator[tuple[list[int], EngineStep]]:
        """The target engine's stream of steps (each: its accepted drafts and its own token,
        with their logprobs if asked); a step late by more than the target's call timeout
        fails the request. Leaving early aborts the request there."""
        request = GenerateRequest(seq_id, list(gen.prompt_ids), gen.max_tokens, gen.sampling, gen.seed,
                                  tuple(sorted(gen.ends_on(self.eos_token_ids))), gen.ignore_eos,
                                  logprobs=gen.logprobs, prompt_logprobs=gen.prompt_logprobs)
        response = self.pools["target"].options(stream=True).generate.remote(request)
        try:
            while True:
                started = time.perf_counter()
                try:
                    step = await asyncio.wait_for(response.__anext__(), self.timeouts.target_s)
                except StopAsyncIteration:
                    return
                stats.rounds += 1
                stats.round_ms += (time.perf_counter() - started) * 1000
                yield step.tokens, step
        finally:
            response.cancel()

    async def _round(self, lane: str, seq_id: str, tokens: list[int], gen: Generation,
                     stats: SpeculationStats, ahead: _Ahead) -> Verification:
        started = time.perf_counter()
        cap = gen.max_tokens - (len(tokens) - len(gen.prompt_ids)) - 1   # a round yields up to k + 1 tokens
        if cap == 0 and gen.k > 0:
            # The last token needs no draft: free the draft pool's cache now.
            self._release(lane, seq_id, "draft")
        in_flight = len(self._running)
        levels = {id(control): control.note_load(in_flight) for control in self._controls()}
        control = self._control_of(gen)
        level = levels[id(control)]
        arm, whole = self._arm(gen, control, cap, level)
        k, overlap = arm.k, arm.overlap and not arm.lookup
        stats.k_chosen += k
        fallbacks_before = stats.fallback_rounds
        ready = await self._drafts_ahead(ahead, k, stats)
        if ready is not None:
            drafts, probs, proposal = ready.tokens, ready.probs, None   # drafted off this round's path
        else:
            drafts, probs, proposal = await self._drafts(lane, seq_id, tokens, k, gen, stats, max(cap, 0),
                                                         lookup_alone=arm.lookup)
        # model drafts come with a proposal; a suffix request's drafts are all suffix drafts
        looked_up = bool(drafts) and ready is None and proposal is None
        kind = ("suffix" if gen.method == "suffix" else "ngram") if looked_up else "draft_model"
        verify_started = time.perf_counter()
        verifying = asyncio.ensure_future(self.gatherer.call("target", lane, seq_id, VerifyRequest(
            seq_id, tokens, drafts, probs, gen.sampling, round_seed(gen.seed, stats.rounds, "target"),
            noise_seed=self._noise_seed(gen), prompt_len=len(gen.prompt_ids), logprobs=gen.logprobs,
            prompt_logprobs=gen.prompt_logprobs if stats.rounds == 0 else None,
            steps=self._plain_steps(drafts, cap, stats.rounds), stop_ids=tuple(gen.ends_on(self.eos_token_ids)))))
        if overlap and drafts:
            stats.lookaheads += self._look_ahead(ahead, lane, seq_id, tokens, drafts,
                                                 lookahead_size(k, cap - len(drafts) - 1), gen, stats.rounds)
        verdict = await verifying
        ahead.verdict = verdict
        stats.call_ms += (time.perf_counter() - verify_started) * 1000
        stats.replica_ms += verdict.replica_ms
        if self.metrics is not None:
            # A call after the first that computed the whole sequence again rebuilt its cache.
            rebuilt = {"target": stats.rounds > 0 and verdict.positions_fed >= len(tokens),
                       "draft": stats.rounds > 0 and proposal is not None and proposal.positions_fed >= len(tokens)}
            self.metrics.round(k, len(drafts), verdict, proposal, stats.fallback_rounds > fallbacks_before, rebuilt,
                               lookup=looked_up)
        model_ms = verdict.model_ms + (proposal.model_ms if proposal is not None else 0.0)
        stats.rounds += 1
        stats.drafted_tokens += len(drafts)
        stats.accepted_tokens += verdict.accepted
        if kind == "ngram":
            stats.lookup_rounds += 1
            stats.lookup_drafted_tokens += len(drafts)
            stats.lookup_accepted_tokens += verdict.accepted
        elif kind == "suffix":
            stats.suffix_rounds += 1
            stats.suffix_drafted_tokens += len(drafts)
            stats.suffix_accepted_tokens += verdict.accepted
        stats.verify_batch_rows += verdict.batch_rows
        stats.model_ms += verdict.model_ms
        round_ms = (time.perf_counter() - started) * 1000
        stats.round_ms += round_ms
        stats.retried_calls = self._retries[seq_id]
        for each in self._controls():
            each.observe(levels[id(each)], len(drafts), verdict.accepted, round_ms, model_ms, in_flight,
                         adaptive=gen.adaptive, whole=whole, tokens=len(verdict.tokens), mine=each is control)
        return verdict

    def _controls(self) -> list[KController]:
        return [self.control, *self.lookup_controls.values()]

    def _control_of(self, gen: Generation) -> KController:
        """The measured choice this request's k follows: its method's for lookup and hybrid
        requests, the draft pool's for the others."""
        return self.lookup_controls.get(gen.method, self.control)

    def _plain_steps(self, drafts: list[int], cap: int, round_index: int) -> int:
        """Forward passes a round without drafts asks the target for (VerifyRequest.steps):
        up to decode_steps, within the tokens left; one for the first round, so that the
        first token is not held back."""
        if drafts or round_index == 0:
            return 1
        return max(1, min(self.decode_steps, cap + 1))

    def _arm(self, gen: Generation, control: KController, cap: int, level: int) -> tuple[Arm, bool]:
        """This round's k and overlap: the request's, or the router's measured choice at this
        load level (router/k_control.py); and whether the request's end left the k whole."""
        if gen.adaptive:
            chosen = control.choose(level, control.max_k)
            k, whole = min(chosen.k, cap), chosen.k <= cap
            if control is self.control and not control.prior.ready:
                self._fetch_profiles()
        else:
            chosen, k, whole = None, min(gen.k, cap), gen.k <= cap
        if gen.overlap == "auto":
            overlap = (chosen or control.choose(level, control.max_k)).overlap
        else:
            overlap = bool(gen.overlap)
        return Arm(k, overlap and k > 0, chosen is not None and chosen.lookup and k > 0), whole

    @staticmethod
    def _noise_seed(gen: Generation) -> int | None:
        """The seed of a seeded sampled request's public noise (replicas/gumbel.py)."""
        return gen.seed if gen.seeded and not gen.sampling.greedy else None

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
        stats.draft_ms += lookahead.model_ms
        stats.hidden_draft_ms += lookahead.model_ms
        stats.draft_batch_rows += lookahead.batch_rows
        stats.draft_rounds += 1
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

        async def look() -> Proposal | None:
            try:
                [answer] = await self._send("draft", lane, [request])
            except Exception:  # noqa: BLE001 - a lost lookahead is a miss; the next round drafts
                return None
            return None if isinstance(answer, RowError) else answer
        ahead.task = asyncio.get_running_loop().create_task(look())
        ahead.drafts = list(drafts)
        return 1

    def _fetch_profiles(self) -> None:
        """The pools' cost profiles, once, in the background (a fresh context: it outlives the
        request that asked)."""
        if self._profiles_task is None or (self._profiles_task.done() and not self.control.prior.ready):
            self._profiles_task = asyncio.get_running_loop().create_task(
                self._load_profiles(), context=contextvars.Context())

    async def _load_profiles(self) -> None:
        for pool in self.pools:
            try:
                state = await _within(self.pools[pool].describe.remote(), 30.0)
                self.control.prior.profiles[pool] = CostProfile.from_describe(state)
            except Exception:  # noqa: BLE001 - retried at a later round; the prior waits meanwhile
                logger.warning("no cost profile from the %s pool yet", pool, exc_info=True)

    async def _drafts(self, lane: str, seq_id: str, tokens: list[int], k: int, gen: Generation,
                      stats: SpeculationStats, room: int, lookup_alone: bool = False) -> tuple[list[int], object, object]:
        """k drafts, their probabilities q and the proposal; none when k is 0 or the drafts
        are unavailable. A hybrid round takes up to lookup.k drafts from a long enough match
        instead, whatever its k, within `room` (the drafts the request's end leaves space for);
        with `lookup_alone` (its measured choice, router/k_control.py) k drafts by lookup, as
        ngram would, and never the draft pool's."""
        # Lookup drafts go without probs: q one-hot, as the target's rule then takes it.
        if gen.method == "hybrid" and lookup_alone:
            return lookup_drafts(tokens, k), None, None
        if gen.method == "hybrid" and room > 0:
            drafts, matched = lookup_match(tokens, min(self.lookup.k, room))
            if matched >= self.lookup.hybrid_min_ngram:
                return drafts, None, None
        if k == 0:
            return [], None, None
        if gen.method == "ngram":
            return lookup_drafts(tokens, k), None, None
        if gen.method == "suffix":
            return suffix_drafts(tokens, k, self.outputs), None, None
        if not self.drafts.available:
            stats.fallback_rounds += 1
            return self._fallback_drafts(tokens, k), None, None
        started = time.perf_counter()
        try:
            proposal = await self.gatherer.call("draft", lane, seq_id, ProposeRequest(
                seq_id, tokens, k, gen.sampling, round_seed(gen.seed, stats.rounds, "draft"),
                noise_seed=self._noise_seed(gen), prompt_len=len(gen.prompt_ids)))
        except RowError as exc:   # this sequence's row alone failed on the draft replica
            logger.warning("drafting failed for %s (%s): verifying without drafts", seq_id, exc)
            stats.fallback_rounds += 1
            return self._fallback_drafts(tokens, k), None, None
        except Exception as exc:  # noqa: BLE001 - the pool failed or is late: go on without it
            self.drafts.report_failure(type(exc).__name__)
            stats.fallback_rounds += 1
            return self._fallback_drafts(tokens, k), None, None
        stats.draft_batch_rows += proposal.batch_rows
        stats.draft_rounds += 1
        stats.model_ms += proposal.model_ms
        stats.draft_ms += proposal.model_ms
        stats.call_ms += (time.perf_counter() - started) * 1000
        stats.replica_ms += proposal.replica_ms
        return proposal.tokens, proposal.probs, proposal

    def _fallback_drafts(self, tokens: list[int], k: int) -> list[int]:
        """A round whose draft pool failed or is late drafts by prompt lookup, where the server
        serves it; else (or without a match) it goes on with the target alone."""
        return lookup_drafts(tokens, k) if self.lookup.fallback else []

    async def _send(self, pool: str, lane: str, requests: list) -> list:
        """One call to a pool with the requests of a lane (router/gathering.py): over the
        lane's direct channel when there is one, else (or when it breaks) by handle. A draft
        call gets one attempt within the draft budget: a late draft is no draft."""
        budget_s = self.timeouts.draft_s if pool == "draft" else self.timeouts.target_s
        give_up_at = time.monotonic() + budget_s
        client = self.routes.client(pool, lane) if self.routes is not None else None
        if client is not None:
            try:
                results = await asyncio.wait_for(client.call(_METHODS[pool], requests), budget_s)
                self.call_paths["direct"] += 1
                return results
            except ChannelBroken:
                logger.info("the direct channel to the %s pool broke; this call goes by handle", pool)
                self.routes.forget(pool, lane)
                if pool == "target":   # it may have died with the replica: this is its retry
                    self._retries.update(request.seq_id for request in requests)
            except asyncio.TimeoutError:
                if pool == "draft":
                    raise
                raise TargetTimeout(f"the target pool did not answer within {budget_s:g} s") from None
        self.call_paths["handle"] += 1
        if pool == "draft":
            remaining = max(give_up_at - time.monotonic(), 0.001)
            return await _within(self._lane_handle(pool, lane).propose.remote(requests), remaining)
        return await self._verify(lane, requests, give_up_at)

    async def _channel_address(self, pool: str, lane: str) -> tuple[str, int]:
        return await _within(self._lane_handle(pool, lane).channel_address.remote(), 10.0)

    async def _verify(self, lane: str, requests: list, give_up_at: float) -> list:
        """When the replica died, retry with backoff until Serve routes the call to another
        replica, or has replaced the dead one (a tensor-parallel replica restarts whole); the
        requests carry all their state, so any replica can answer them. Retries and all take
        at most the pool's call timeout."""
        method = self._lane_handle("target", lane).verify
        for attempt in itertools.count():
            try:
                return await _within(method.remote(requests), max(give_up_at - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise TargetTimeout(f"the target pool did not answer within {self.timeouts.target_s:g} s") from None
            except (RayActorError, ReplicaUnavailableError) as exc:
                if time.monotonic() >= give_up_at:
                    raise TargetUnavailable(f"no target replica could serve the call ({type(exc).__name__})") from None
                self._retries.update(request.seq_id for request in requests)
                logger.warning("replica died during a verify call; retrying (attempt %d)", attempt + 2)
                await asyncio.sleep(min(_RETRY_BACKOFF_S * 2 ** attempt, _LONGEST_RETRY_PAUSE_S))

    async def _probe_drafts(self) -> None:
        await self.pools["draft"].describe.remote()

    @functools.cache
    def _lane_handle(self, pool: str, lane: str):
        return self.pools[pool].options(session_id=lane)

    def _release(self, lane: str, seq_id: str, *pools: str) -> None:
        """Free the sequence's caches; not awaited, since nothing depends on it. Sent from a
        fresh context: Serve cancels the calls a cancelled request (a client that went away)
        makes, and these are made as it unwinds."""
        for pool in (pool for pool in pools if pool in self.pools):
            try:
                contextvars.Context().run(self._lane_handle(pool, lane).release.remote, seq_id)
            except Exception:  # noqa: BLE001 - a failed cleanup only costs cache space (LRU)
                logger.warning("could not release caches of %s", seq_id, exc_info=True)

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


async def _within(response, timeout_s: float):
    """Await a DeploymentResponse for at most timeout_s; cancel the call when it is late."""
    async def result():
        return await response
    try:
        return await asyncio.wait_for(result(), timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise
