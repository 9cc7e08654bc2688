"""Drafts from specserve's draft pool for a vLLM target engine: a vLLM `custom_class` proposer.

vLLM (0.32) builds this class in each of its workers with the engine's VllmConfig and, once
per engine step, calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`:
row i of the running batch has the context token_ids_cpu[i, :num_tokens_no_spec[i]] (the
tokens just sampled included); a row without sampled tokens wants no drafts. The answer is a
list of draft id lists, one per row, each of at most k ids (empty: a plain target step).

vLLM verifies the drafts with its own rejection sampler. It gets no draft distribution q from
a custom proposer and treats each draft as one-hot (accept x with probability p(x), else
sample the residual p with x removed): exact for greedy and sampled requests alike. The drafts
are proposed greedily, so q is one-hot at the draft's argmax and the rule is the standard one.
What it costs is acceptance at temperature > 0 (p(x) instead of min(1, p(x) / q(x)) with the
draft's own q).

The proposer never raises into the engine (an exception there ends vLLM): a draft pool that is
slow, missing or broken means no drafts for that step. It reaches the draft replicas over
their direct channels (replicas/direct_channel.py); the target replica that started vLLM
(replicas/engines/vllm/target.py) writes their addresses to the file named by SPECSERVE_DRAFT_ROUTES
and refreshes it while it runs, and puts the channel key in SPECSERVE_CHANNEL_KEY (hex) before
vLLM starts its workers. vLLM passes no request ids here, so the proposer names the rows itself
(SequenceNames): a row whose context extends a sequence's context of the last step continues
that sequence (the draft replica extends its cache), any other row starts one, and a
sequence no row continues is finished: its draft replica is told to release it, as the
router does at the end of a request, so that its cache is freed and it no longer counts in
the demand the draft pool autoscales on. A mistaken continuation costs a cache rebuild, never
a wrong draft: every call carries all its tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import threading
import time
import uuid

import numpy as np

from replicas.engines.vllm import cpu_fixes
from replicas.direct_channel import ChannelClient
from replicas.protocol import Proposal, ProposeRequest
from replicas.sampling import GREEDY

logger = logging.getLogger(__name__)
ROUTES_ENV, KEY_ENV, TIMEOUT_ENV = "SPECSERVE_DRAFT_ROUTES", "SPECSERVE_CHANNEL_KEY", "SPECSERVE_DRAFT_TIMEOUT_S"
_ROUTES_TTL_S = 2.0
_IDLE_S = 1.0              # no step for this long: vLLM has no running requests, all are finished


class RemoteDraftProposer:
    def __init__(self, vllm_config):
        cpu_fixes.install()     # built in each worker before its first step: in time
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.key = bytes.fromhex(os.environ.get(KEY_ENV, ""))
        self.routes_path = os.environ.get(ROUTES_ENV, "")
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, "1.0"))
        self.calls = self.failures = 0
        self._addresses: list[tuple[str, int]] = []
        self._read_at = -_ROUTES_TTL_S
        self._clients: dict[tuple[str, int], ChannelClient] = {}
        self._names = SequenceNames()
        self._names_lock = threading.Lock()     # the engine's steps and the idle sweep
        self._stepped_at = time.monotonic()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="specserve-drafts", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._sweep_when_idle(), self._loop)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner hands the proposer the target model; drafts come from elsewhere."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not _first_rank():      # every tensor-parallel rank has a proposer; vLLM uses rank 0's
            return drafts
        try:
            rows = [i for i, sampled in enumerate(sampled_token_ids)
                    if len(sampled) and int(num_tokens_no_spec[i]) + self.k < self.max_model_len]
            contexts = {i: token_ids_cpu[i, :int(num_tokens_no_spec[i])] for i in rows}
            with self._names_lock:
                self._stepped_at = time.monotonic()
                names, finished = self._names.step(contexts)
            self._release(finished)
            if rows:
                for i, tokens in self._drafts(contexts, names).items():
                    drafts[i] = tokens[:self.k]
        except Exception:  # noqa: BLE001 - never into the engine: this step goes without drafts
            self.failures += 1
            logger.debug("no drafts for this step", exc_info=True)
        return drafts

    def _drafts(self, contexts: dict[int, np.ndarray], names: dict[int, str]) -> dict[int, list[int]]:
        """Draft ids per row, from one call per draft replica the rows' sequences hash to."""
        addresses = self._routes()
        if not addresses or not self.key:
            return {}
        by_replica: dict[tuple[str, int], list[int]] = {}
        calls: dict[tuple[str, int], list[ProposeRequest]] = {}
        for i, tokens in contexts.items():
            address = self._replica_of(names[i], addresses)
            by_replica.setdefault(address, []).append(i)
            calls.setdefault(address, []).append(ProposeRequest(names[i], tokens.tolist(), self.k, GREEDY, seed=0))
        self.calls += 1
        answers = asyncio.run_coroutine_threadsafe(self._call_all(calls), self._loop).result(self.timeout_s)
        found = {}
        for address, rows in by_replica.items():
            for i, answer in zip(rows, answers.get(address) or []):
                if isinstance(answer, Proposal):
                    found[i] = list(answer.tokens)
        return found

    @staticmethod
    def _replica_of(seq_id: str, addresses: list[tuple[str, int]]) -> tuple[str, int]:
        return addresses[int(seq_id[-8:], 16) % len(addresses)]

    def _release(self, seq_ids: list[str]) -> None:
        """Tell the sequences' draft replicas they are finished; nothing waits for it."""
        addresses = self._routes()
        if not seq_ids or not addresses or not self.key:
            return
        by_replica: dict[tuple[str, int], list[str]] = {}
        for seq_id in seq_ids:
            by_replica.setdefault(self._replica_of(seq_id, addresses), []).append(seq_id)
        asyncio.run_coroutine_threadsafe(self._call_all(by_replica, "release"), self._loop)

    async def _sweep_when_idle(self) -> None:
        """vLLM takes no step without running requests, so the last ones to finish are not
        seen to finish by a step: after _IDLE_S without one, every sequence is finished."""
        while True:
            await asyncio.sleep(_IDLE_S / 2)
            with self._names_lock:
                idle = time.monotonic() - self._stepped_at >= _IDLE_S
                finished = self._names.step({})[1] if idle else []
            self._release(finished)

    async def _call_all(self, calls: dict, method: str = "propose") -> dict:
        async def one(address, requests):
            client = self._clients.get(address)
            if client is None or client.broken:
                client = self._clients[address] = ChannelClient(self.key, address)
            try:
                return address, await client.call(method, requests)
            except Exception:  # noqa: BLE001 - this replica's rows go without drafts
                self._read_at = -_ROUTES_TTL_S      # read the routes again: it may have been replaced
                return address, None
        return dict(await asyncio.gather(*(one(address, requests) for address, requests in calls.items())))

    def _routes(self) -> list[tuple[str, int]]:
        now = time.monotonic()
        if now - self._read_at >= _ROUTES_TTL_S and self.routes_path:
            self._read_at = now
            try:
                with open(self.routes_path) as handle:
                    self._addresses = [tuple(address) for address in json.load(handle)]
            except (OSError, ValueError):
                pass   # not written yet, or being replaced: keep what was known
        return self._addresses


def _first_rank() -> bool:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - no tensor parallelism set up (one process): the only rank
        return True


class SequenceNames:
    """Names the rows of vLLM's running batch as sequences of the draft pool, step by step.

    A row continues the sequence whose context at the last step is a prefix of the row's
    context now (the tokens vLLM accepted since extend it): its own row's sequence first,
    since vLLM keeps a running request in its row until others finish and rows are packed.
    Any other row starts a new sequence. The last step's sequences that no row continued are
    finished."""

    def __init__(self):
        self.contexts: dict[str, np.ndarray] = {}     # sequence -> its context at the last step
        self.rows: dict[int, str] = {}                # row -> its sequence at the last step
        self.finished_contexts: dict[str, np.ndarray] = {}   # the last step's finished ones: their contexts

    def step(self, contexts: dict[int, np.ndarray]) -> tuple[dict[int, str], list[str]]:
        """contexts: row -> its context now. The rows' sequence ids, and the finished ones."""
        names: dict[int, str] = {}
        continued: set[str] = set()
        for row, tokens in contexts.items():
            names[row] = self._continued(row, tokens, continued) or f"vllm-{uuid.uuid4().hex}"
            continued.add(names[row])
        finished = [seq_id for seq_id in self.contexts if seq_id not in continued]
        self.finished_contexts = {seq_id: self.contexts[seq_id] for seq_id in finished}
        self.contexts = {names[row]: tokens.copy() for row, tokens in contexts.items()}
        self.rows = names
        return names, finished

    def _continued(self, row: int, tokens: np.ndarray, taken: set[str]) -> str | None:
        own = self.rows.get(row)
        for seq_id in itertools.chain([own] if own else [], self.contexts):   # lazily: its own row mostly
            before = self.contexts[seq_id]
            if seq_id not in taken and len(before) <= len(tokens) and np.array_equal(tokens[:len(before)], before):
                return seq_id
        return None
