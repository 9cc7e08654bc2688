"""Per-sequence KV caches under a token budget.

A replica keeps, for each sequence it has seen, the keys and values of the token ids it last
computed. The store is only ever a shortcut (every call carries the full token ids), so under
memory pressure it simply forgets the least recently used sequences; their next call
recomputes what was dropped and gets the same logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# Per layer: (keys, values), each [1, kv_heads, len(tokens), head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class SequenceKV:
    tokens: list[int]          # the ids whose keys/values `layers` hold, in order
    layers: list[LayerKV]

    def __len__(self) -> int:
        return len(self.tokens)


class KVCacheStore:
    """LRU store of SequenceKV, holding at most `max_tokens` cached positions in all."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, SequenceKV] = OrderedDict()
        self._tokens = 0
        self.evictions = 0

    def get(self, seq_id: str) -> SequenceKV | None:
        entry = self._entries.get(seq_id)
        if entry is not None:
            self._entries.move_to_end(seq_id)
        return entry

    def put(self, seq_id: str, entry: SequenceKV) -> None:
        """Store as most recently used, then evict the least recently used beyond the budget.
        A sequence longer than the whole budget is not kept at all."""
        self.drop(seq_id)
        if len(entry) > self.max_tokens:
            self.evictions += 1
            return
        self._entries[seq_id] = entry
        self._tokens += len(entry)
        while self._tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted)
            self.evictions += 1

    def drop(self, seq_id: str) -> None:
        entry = self._entries.pop(seq_id, None)
        if entry is not None:
            self._tokens -= len(entry)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
