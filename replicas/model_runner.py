"""One causal LM and the KV caches of the sequences it has seen.

A sequence's cache is kept under its id together with the token ids it covers. Every call
carries the sequence's full token ids, so the cache is only ever a shortcut: the runner
reuses the longest common prefix of what it holds and what it is asked for, and computes the
rest in one forward pass. A replica that never saw the sequence, or dropped it, computes more
and returns the same logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class SequenceCache:
    tokens: list[int] = field(default_factory=list)  # the ids whose keys/values `kv` holds
    kv: DynamicCache | None = None


@dataclass(frozen=True)
class Extension:
    logits: torch.Tensor   # [num_logits, V], float32, for the last num_logits positions
    positions_fed: int     # positions computed by this call's forward pass


class KVCacheStore:
    """Per-sequence caches, least recently used dropped first beyond max_sequences."""

    def __init__(self, max_sequences: int):
        self.max_sequences = max_sequences
        self._entries: OrderedDict[str, SequenceCache] = OrderedDict()

    def take(self, seq_id: str) -> SequenceCache:
        entry = self._entries.pop(seq_id, None) or SequenceCache()
        self._entries[seq_id] = entry
        while len(self._entries) > self.max_sequences:
            self._entries.popitem(last=False)
        return entry

    def drop(self, seq_id: str) -> None:
        self._entries.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class ModelRunner:
    def __init__(self, model: PreTrainedModel, max_sequences: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.caches = KVCacheStore(max_sequences)

    @torch.inference_mode()
    def extend(self, seq_id: str, tokens: list[int], num_logits: int) -> Extension:
        """Make seq_id's cache cover `tokens`; return logits of its last num_logits positions.

        Position j's logits predict token j + 1. Only positions past the reusable cached
        prefix are fed, and at least num_logits of them.
        """
        entry = self.caches.take(seq_id)
        reuse = min(common_prefix_length(entry.tokens, tokens), len(tokens) - num_logits)
        if entry.kv is None or reuse == 0:
            entry.kv, reuse = DynamicCache(config=self.model.config), 0
        else:
            entry.kv.crop(reuse - entry.kv.get_seq_length())  # negative: drop that many positions
        new_ids = torch.tensor([tokens[reuse:]], device=self.device)  # [1, fed]
        try:
            output = self.model(input_ids=new_ids, cache=entry.kv, use_cache=True,
                                logits_to_keep=num_logits)
        except BaseException:
            self.caches.drop(seq_id)  # a half-updated cache must never be reused
            raise
        entry.tokens = list(tokens)
        logits = output.logits[0, -num_logits:].float().cpu()  # [num_logits, V]
        return Extension(logits, positions_fed=len(tokens) - reuse)

    def release(self, seq_id: str) -> None:
        self.caches.drop(seq_id)
