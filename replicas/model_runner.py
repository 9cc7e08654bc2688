"""One causal LM, the KV caches of the sequences it has seen, and batched forward passes.

Every call carries a sequence's full token ids, so a cache is only ever a shortcut: the
runner reuses the longest common prefix of what it holds and what it is asked for, and
computes the rest. A replica that never saw the sequence, or evicted it, computes more and
returns the same logits.

Batching: the calls of one `extend_batch` run as one forward pass (or a few, see
`_padding_groups`). Rows have different cached lengths P_b and new lengths N_b, so the batch
is laid out per row as

    [ left padding | cached P_b ][ new N_b | right padding ]
      <----------- P ----------> <------------ N --------->

with P = max P_b and N = max N_b. The attention mask hides the left padding; the right
padding is invisible to real positions by causality, and its outputs are discarded. RoPE
positions are per row (P_b + j), and cached keys already carry theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from replicas.kv_cache import KVCacheStore, SequenceKV

# Rows are grouped so that padded new positions are at most this multiple of the real ones:
# one long prompt must not make every short verify in its batch pay for its length.
_MAX_PADDING_FACTOR = 2


@dataclass(frozen=True)
class ExtendCall:
    seq_id: str
    tokens: list[int]      # the sequence's full token ids
    num_logits: int        # logits wanted for the last num_logits positions (>= 1)


@dataclass(frozen=True)
class Extension:
    logits: torch.Tensor   # [num_logits, V], float32, for the last num_logits positions
    positions_fed: int     # positions computed for this sequence
    batch_rows: int        # sequences in the forward pass that computed it
    batch_positions: int   # positions that forward pass computed, over all its sequences


@dataclass(frozen=True)
class _Row:
    call: ExtendCall
    past: SequenceKV | None
    reuse: int             # cached positions reused: the row's P_b

    @property
    def new_ids(self) -> list[int]:
        return self.call.tokens[self.reuse:]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class ModelRunner:
    def __init__(self, model: PreTrainedModel, max_cached_tokens: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.pad_id = model.config.pad_token_id or 0
        self.caches = KVCacheStore(max_cached_tokens)

    def extend(self, seq_id: str, tokens: list[int], num_logits: int) -> Extension:
        """Make seq_id's cache cover `tokens`; return logits of its last num_logits positions.
        Position j's logits predict token j + 1."""
        return self.extend_batch([ExtendCall(seq_id, tokens, num_logits)])[0]

    @torch.inference_mode()
    def extend_batch(self, calls: list[ExtendCall]) -> list[Extension]:
        rows = [self._plan(call) for call in calls]
        results: list[Extension | None] = [None] * len(calls)
        for group in _padding_groups(rows):
            try:
                extensions = self._forward([rows[i] for i in group])
            except BaseException:
                for row in rows:  # a half-updated cache must never be reused
                    self.caches.drop(row.call.seq_id)
                raise
            for i, extension in zip(group, extensions):
                results[i] = extension
        return results

    def release(self, seq_id: str) -> None:
        self.caches.drop(seq_id)

    def _plan(self, call: ExtendCall) -> _Row:
        past = self.caches.get(call.seq_id)
        if past is None:
            return _Row(call, None, 0)
        reuse = min(common_prefix_length(past.tokens, call.tokens), len(call.tokens) - call.num_logits)
        return _Row(call, past if reuse > 0 else None, max(reuse, 0))

    def _forward(self, rows: list[_Row]) -> list[Extension]:
        P = max(row.reuse for row in rows)
        N = max(len(row.new_ids) for row in rows)
        input_ids = torch.full((len(rows), N), self.pad_id, dtype=torch.long)       # [B, N]
        positions = torch.empty((len(rows), N), dtype=torch.long)                   # [B, N]
        for b, row in enumerate(rows):
            input_ids[b, :len(row.new_ids)] = torch.tensor(row.new_ids)
            positions[b] = torch.arange(row.reuse, row.reuse + N)
        padded = any(row.reuse != P or len(row.new_ids) != N for row in rows)
        output = self.model(input_ids=input_ids.to(self.device), position_ids=positions.to(self.device),
                            attention_mask=_attention_mask(rows, P, N).to(self.device) if padded else None,
                            cache=self._batched_past(rows, P), use_cache=True)
        logits = output.logits.float().cpu()                                        # [B, N, V]
        extensions, batch_positions = [], sum(len(row.new_ids) for row in rows)
        for b, row in enumerate(rows):
            fed, wanted = len(row.new_ids), row.call.num_logits
            self.caches.put(row.call.seq_id, SequenceKV(list(row.call.tokens), _row_kv(output.cache, b, P - row.reuse, P + fed)))
            extensions.append(Extension(logits[b, fed - wanted:fed], positions_fed=fed, batch_rows=len(rows),
                                        batch_positions=batch_positions))
        return extensions

    def _batched_past(self, rows: list[_Row], P: int) -> DynamicCache:
        """The rows' reused keys/values, left-padded to P: per layer [B, kv_heads, P, head_dim]."""
        if P == 0:
            return DynamicCache(config=self.model.config)
        template = next(row.past for row in rows if row.past is not None).layers
        layers = []
        for index, (keys, values) in enumerate(template):
            shape = (len(rows), keys.shape[1], P, keys.shape[3])
            if len(rows) == 1:
                layers.append((keys[:, :, :P], values[:, :, :P]))
                continue
            batch_keys, batch_values = keys.new_zeros(shape), values.new_zeros(shape)
            for b, row in enumerate(rows):
                if row.reuse:
                    row_keys, row_values = row.past.layers[index]
                    batch_keys[b, :, P - row.reuse:] = row_keys[0, :, :row.reuse]
                    batch_values[b, :, P - row.reuse:] = row_values[0, :, :row.reuse]
            layers.append((batch_keys, batch_values))
        return DynamicCache(ddp_cache_data=layers, config=self.model.config)


def _attention_mask(rows: list[_Row], P: int, N: int) -> torch.Tensor:
    """[B, 1, N, P + N] bool, True where a query may attend: causal, minus left padding."""
    query = torch.arange(N)[:, None]                         # [N, 1]
    key = torch.arange(P + N)[None, :]                       # [1, P + N]
    causal = key <= P + query                                # [N, P + N]
    first_real = torch.tensor([P - row.reuse for row in rows])[:, None, None]  # [B, 1, 1]
    return (causal[None] & (key[None] >= first_real))[:, None]


def _row_kv(cache: DynamicCache, b: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row b's keys/values over columns [start, end), as its own tensors [1, kv_heads, end - start, head_dim]."""
    layers = []
    for layer in cache.layers:
        keys, values = layer.keys[b:b + 1, :, start:end], layer.values[b:b + 1, :, start:end]
        whole = layer.keys.shape[0] == 1 and start == 0 and end == layer.keys.shape[2]
        layers.append((keys, values) if whole else (keys.clone(), values.clone()))
    return layers


def _padding_groups(rows: list[_Row]) -> list[list[int]]:
    """Indices of rows, grouped by new length so that padding stays within _MAX_PADDING_FACTOR."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].new_ids))
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        n = len(rows[i].new_ids)
        if current and (len(current) + 1) * n > _MAX_PADDING_FACTOR * (real + n):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        groups.append(current)
    return groups
