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
(replicas/vllm_target.py) writes their addresses to the file named by SPECSERVE_DRAFT_ROUTES
and refreshes it while it runs, and puts the channel key in SPECSERVE_CHANNEL_KEY (hex) before
vLLM starts its workers. vLLM passes no request ids here, so a row's sequence id for the
draft pool's cache is a hash of its first tokens: two requests with the same prompt share it,
which costs the draft cache a rebuild, never a wrong draft (every call carries all its tokens).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time

from replicas import vllm_cpu_fixes
from replicas.direct_channel import ChannelClient
from replicas.protocol import Proposal, ProposeRequest
from replicas.sampling import GREEDY

logger = logging.getLogger(__name__)
ROUTES_ENV, KEY_ENV, TIMEOUT_ENV = "SPECSERVE_DRAFT_ROUTES", "SPECSERVE_CHANNEL_KEY", "SPECSERVE_DRAFT_TIMEOUT_S"
_ROUTES_TTL_S = 2.0
_SEQ_ID_TOKENS = 64        # the leading tokens that name a row's sequence in the draft pool


class RemoteDraftProposer:
    def __init__(self, vllm_config):
        vllm_cpu_fixes.install()     # built in each worker before its first step: in time
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
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="specserve-drafts", daemon=True).start()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner hands the proposer the target model; drafts come from elsewhere."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not _first_rank():      # every tensor-parallel rank has a proposer; vLLM uses rank 0's
            return drafts
        try:
            rows = [i for i, sampled in enumerate(sampled_token_ids)
                    if len(sampled) and int(num_tokens_no_spec[i]) + self.k < self.max_model_len]
            if rows:
                contexts = {i: token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist() for i in rows}
                for i, tokens in self._drafts(contexts).items():
                    drafts[i] = tokens[:self.k]
        except Exception:  # noqa: BLE001 - never into the engine: this step goes without drafts
            self.failures += 1
            logger.debug("no drafts for this step", exc_info=True)
        return drafts

    def _drafts(self, contexts: dict[int, list[int]]) -> dict[int, list[int]]:
        """Draft ids per row, from one call per draft replica the rows hash to."""
        addresses = self._routes()
        if not addresses or not self.key:
            return {}
        by_replica: dict[tuple[str, int], list[int]] = {}
        calls: dict[tuple[str, int], list[ProposeRequest]] = {}
        for i, tokens in contexts.items():
            seq_id = _sequence_id(tokens)
            address = addresses[int(seq_id[-8:], 16) % len(addresses)]
            by_replica.setdefault(address, []).append(i)
            calls.setdefault(address, []).append(ProposeRequest(seq_id, tokens, self.k, GREEDY, seed=0))
        self.calls += 1
        answers = asyncio.run_coroutine_threadsafe(self._call_all(calls), self._loop).result(self.timeout_s)
        found = {}
        for address, rows in by_replica.items():
            for i, answer in zip(rows, answers.get(address) or []):
                if isinstance(answer, Proposal):
                    found[i] = list(answer.tokens)
        return found

    async def _call_all(self, calls: dict) -> dict:
        async def one(address, requests):
            client = self._clients.get(address)
            if client is None or client.broken:
                client = self._clients[address] = ChannelClient(self.key, address)
            try:
                return address, await client.call("propose", requests)
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


def _sequence_id(tokens: list[int]) -> str:
    head = ",".join(map(str, tokens[:_SEQ_ID_TOKENS])).encode()
    return "vllm-" + hashlib.sha1(head).hexdigest()
