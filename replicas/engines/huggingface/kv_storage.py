"""A replica's keys and values, preallocated, and the window of it one forward pass uses.

Per layer the storage holds keys and values as [slots + 1, kv_heads, max_seq_len, head_dim]
(slot 0 is scratch, replicas/engines/huggingface/kv_cache.py says which sequence owns which slot). A batched
forward pass runs over the adjacent slots lo..hi that hold its rows (R = hi - lo + 1 rows,
some of them holes: slots of sequences not in this batch, fed dummy tokens). Each layer

- writes the new keys/values of row r, position j at (slot lo + r, P_r + j) when j is one of
  the row's N_r new positions, and at the scratch slot otherwise (right padding, holes);
- attends over storage[lo:hi+1, :, :L] with L = max(P_r + N_r): a view, so no sequence's
  cache is copied; the mask lets row r's query j see its own slot's positions 0..P_r + j.

Shapes: R rows, N = max N_r new positions per row, L attended positions per row.

A CUDA graph cannot attend a view that starts at another slot each call: GatheredWindow reads
the rows' slots by index instead (a copy of the window a layer, cuda_graphs.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.engines.huggingface.kv_cache import SCRATCH_SLOT, SlotMove


class SlotStorage:
    """Per-layer key and value tensors of `capacity + 1` slots, allocated at a layer's first
    write (a tensor-parallel shard learns its head count from the keys it computes)."""

    def __init__(self, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.capacity = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.generation = 0     # counts (re)allocations: a CUDA graph holds the tensors' addresses

    def ensure_capacity(self, capacity: int, budget: int | None = None) -> None:
        """Grow every allocated layer to `capacity` slots (doubling, so growth is rare, but
        not past the store's slot `budget` unless `capacity` itself is: with prefix caching
        the store fills its budget, and doubling would allocate up to twice it)."""
        if capacity <= self.capacity:
            return
        doubled = 2 * self.capacity if budget is None else min(2 * self.capacity, budget)
        grown = max(capacity, doubled)
        for index, layer in enumerate(self.layers):
            if layer is not None:
                self.layers[index] = tuple(_grow(tensor, grown + 1) for tensor in layer)
        self.capacity = grown
        self.generation += 1

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values, allocated in the shape of `like` [R, H, N, D]."""
        while len(self.layers) <= index:
            self.layers.append(None)
        if self.layers[index] is None:
            shape = (self.capacity + 1, like.shape[1], self.max_seq_len, like.shape[3])
            self.layers[index] = (like.new_zeros(shape), like.new_zeros(shape))
            self.generation += 1
        return self.layers[index]

    def move(self, moves: list[SlotMove]) -> None:
        for move in moves:
            for layer in self.layers:
                for tensor in layer or ():
                    tensor[move.destination, :, :move.length] = tensor[move.source, :, :move.length]

    def sequence(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One slot's first `length` keys and values per layer, [1, H, length, D] views."""
        return [(k[slot:slot + 1, :, :length], v[slot:slot + 1, :, :length]) for k, v in self.layers if k is not None]


def _grow(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    grown = tensor.new_zeros((slots, *tensor.shape[1:]))
    grown[:tensor.shape[0]] = tensor
    return grown


@dataclass(frozen=True)
class RowLayout:
    """Where each of a forward pass's rows reads and writes."""
    lo: int                      # the window is slots lo..lo + rows - 1
    rows: int                    # R
    attended: int                # L
    write_slot: torch.Tensor     # [R, N] long: the slot position (r, j) is written to
    write_position: torch.Tensor  # [R, N] long: the position in that slot


class BatchWindow:
    """What the model's attention layers see as their cache during one forward pass:
    `update` stores a layer's new keys/values in the slots and returns the window to attend."""

    def __init__(self, storage: SlotStorage, layout: RowLayout):
        self.storage, self.layout = storage, layout

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """keys, values [R, H, N, D] -> the window's keys and values [R, H, L, D] (views)."""
        stored = _write(self.storage, layer_idx, keys, values, self.layout.write_slot, self.layout.write_position)
        window = slice(self.layout.lo, self.layout.lo + self.layout.rows)
        return tuple(tensor[window, :, :self.layout.attended] for tensor in stored)


class GatheredWindow:
    """BatchWindow over slots named by a tensor of slot indices, not a range of them, so that
    every input of the pass is a tensor whose address stays put (a CUDA graph's replay reads
    and writes the addresses it was captured with). The window is a copy: [R, H, L, D] per
    layer for keys and again for values, read from the storage and written once more."""

    def __init__(self, storage: SlotStorage, write_slot: torch.Tensor, write_position: torch.Tensor,
                 read_slots: torch.Tensor, attended: int):
        """write_slot, write_position [R, N] as in RowLayout; read_slots [R]: row r attends that
        slot's first `attended` positions."""
        self.storage, self.write_slot, self.write_position = storage, write_slot, write_position
        self.read_slots, self.attended = read_slots, attended

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        stored = _write(self.storage, layer_idx, keys, values, self.write_slot, self.write_position)
        return tuple(tensor[:, :, :self.attended].index_select(0, self.read_slots) for tensor in stored)


def _write(storage: SlotStorage, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
           write_slot: torch.Tensor, write_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store a layer's new keys and values [R, H, N, D] at (write_slot, write_position) [R, N];
    returns the layer's whole storage."""
    stored_keys, stored_values = storage.layer(layer_idx, keys)
    stored_keys.transpose(1, 2).index_put_((write_slot, write_position), keys.transpose(1, 2))
    stored_values.transpose(1, 2).index_put_((write_slot, write_position), values.transpose(1, 2))
    return stored_keys, stored_values


def layout_rows(lo: int, reuse: list[int], new: list[int], device: torch.device) -> tuple[RowLayout, torch.Tensor, torch.Tensor]:
    """For window rows r with P_r = reuse[r] cached and N_r = new[r] new positions (N_r = 0 for
    a hole): the layout, RoPE positions [R, N] and the attention mask [R, 1, N, L] (bool,
    True where a query may attend)."""
    rows, width = len(reuse), max(new)
    attended = max(p + n for p, n in zip(reuse, new))
    cached = torch.tensor(reuse)[:, None]                                  # [R, 1]
    column = torch.arange(width)[None, :]                                  # [1, N]
    real = column < torch.tensor(new)[:, None]                             # [R, N]
    slot = torch.arange(lo, lo + rows)[:, None].expand(rows, width)
    write_slot = torch.where(real, slot, torch.full_like(slot, SCRATCH_SLOT))
    write_position = torch.where(real, cached + column, column)
    positions = cached + column                                            # [R, N]
    key = torch.arange(attended)[None, None, :]                            # [1, 1, L]
    mask = key <= positions[:, :, None]                                    # [R, N, L]
    layout = RowLayout(lo, rows, attended, write_slot.to(device), write_position.to(device))
    return layout, positions.to(device), mask[:, None].to(device)
