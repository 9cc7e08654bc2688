"""Which sequence's keys and values live in which slot of a replica's KV storage.

The storage (replicas/engines/huggingface/kv_storage.py) is preallocated per layer as `slots` of `max_seq_len`
positions; a sequence's cached keys and values sit in one slot at positions 0..len-1, where
a batched forward pass reads them in place and writes its new positions next to them.
Slot 0 is scratch: a forward pass writes its padding there, so no sequence's slot ever
holds anything but its own tokens' keys and values.

The store is only ever a shortcut (every call carries the full token ids), so under memory
pressure it simply forgets the least recently used sequences; their next call recomputes
what was dropped and gets the same logits. The budget is counted two ways, both bounding
memory: cached positions (`max_tokens`) and slots (`max_tokens // max_seq_len`, at least 1).
A batch that needs more slots than that grows the storage while it runs; the store then
keeps no more sequences than the budget allows.

A finished sequence's cache is kept too (`retire`), as the first to evict: a later sequence
whose tokens begin the same way (the same prompt asked again, a shared system prompt, the
next turn of a chat) takes the longest such prefix from any cached sequence, retired or
running (`share_prefix`), instead of computing it; vLLM calls this automatic prefix caching.
A retired donor hands its slot over; a running one's prefix is copied into a slot of the
new sequence's own.

Batches run over a range of adjacent slots (the batch's own plus a few holes that compute
nothing anyone keeps), so `place` keeps a batch's slots close: new sequences take free
slots next to the batch's others, and a batch spread too thin is moved together once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass

SCRATCH_SLOT = 0
MIN_SHARED_PREFIX = 16     # positions: a shorter common start (a BOS token, a word) is not looked for


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Retired:
    """The index key of a finished sequence's cache: no call names it."""
    number: int


@dataclass
class CachedSequence:
    tokens: list[int]      # the ids whose keys/values its slot holds, at positions 0..len-1
    slot: int

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class SlotMove:
    source: int
    destination: int
    length: int            # leading positions worth copying


def tolerated_span(rows: int) -> int:
    """The widest slot range a batch of `rows` runs over before it is moved together: the
    holes compute dummy rows, cheap next to moving every row's cache."""
    return rows + max(2, rows // 2)


class KVCacheStore:
    """LRU index of cached sequences and their slots, under a position and a slot budget."""

    def __init__(self, max_tokens: int, max_seq_len: int):
        self.max_tokens = max_tokens
        self.max_slots = max(1, max_tokens // max_seq_len)
        self.capacity = 0                  # slots 1..capacity exist in the storage
        self.evictions = 0
        self.moves = 0                     # sequences' caches moved to bring a batch together
        self.reused_positions = 0          # positions calls found cached, so not computed again
        self.computed_positions = 0        # positions forward passes computed
        self.sequence_rows = 0             # rows of forward passes that were sequences
        self.window_rows = 0               # rows they computed, holes in their slot windows included
        self.shared_positions = 0          # positions new sequences took from other sequences' caches
        self._entries: OrderedDict[str | Retired, CachedSequence] = OrderedDict()
        self._retired_numbers = itertools.count()
        self._free: list[int] = []         # a heap: the lowest free slot first
        self._tokens = 0

    def get(self, seq_id: str) -> CachedSequence | None:
        entry = self._entries.get(seq_id)
        if entry is not None:
            self._entries.move_to_end(seq_id)
        return entry

    def place(self, seq_ids: list[str], reuse: dict[str, int]) -> tuple[dict[str, int], list[SlotMove]]:
        """Slots for one forward pass over `seq_ids` (distinct), and the copies the storage
        must make first. A sequence with reuse[seq_id] > 0 keeps its cached positions (moved
        along when its slot moves); any other is dropped from the index and gets a slot to
        compute in. Slots of the batch are taken out of the index until `commit`."""
        batch = set(seq_ids)
        slots: dict[str, int] = {}
        for seq_id in seq_ids:
            entry = self._entries.pop(seq_id, None)
            if entry is None:
                continue
            self._tokens -= len(entry)
            if reuse.get(seq_id, 0) > 0:
                slots[seq_id] = entry.slot
            else:
                heapq.heappush(self._free, entry.slot)
        for seq_id in seq_ids:
            if seq_id not in slots:
                slots[seq_id] = self._take_slot(near=slots.values(), batch=batch)
        moves: list[SlotMove] = []
        if max(slots.values()) - min(slots.values()) + 1 > tolerated_span(len(seq_ids)):
            moves = self._gather(slots, reuse)
        return slots, moves

    def count_forward(self, reused: int, computed: int) -> None:
        self.reused_positions += reused
        self.computed_positions += computed

    def count_rows(self, sequences: int, window: int) -> None:
        """A forward pass over `sequences` ran over a window of `window` slots (holes between)."""
        self.sequence_rows += sequences
        self.window_rows += window

    def commit(self, seq_id: str, tokens: list[int], slot: int) -> None:
        """The forward pass left `tokens`' keys/values in `slot`: index them as most recently
        used, then evict the least recently used beyond the budgets. A sequence longer than
        the whole position budget is not kept at all."""
        entry = CachedSequence(list(tokens), slot)
        if len(entry) > self.max_tokens:
            self.evictions += 1
            heapq.heappush(self._free, slot)
            return
        self._entries[seq_id] = entry
        self._tokens += len(entry)
        while self._tokens > self.max_tokens or len(self._entries) > self.max_slots:
            _, evicted = self._entries.popitem(last=False)
            self._release(evicted)
            self.evictions += 1

    def retire(self, seq_id: str) -> None:
        """seq_id has finished: its cache stays as a donor of prefixes, first to be evicted."""
        entry = self._entries.pop(seq_id, None)
        if entry is not None:
            key = Retired(next(self._retired_numbers))
            self._entries[key] = entry
            self._entries.move_to_end(key, last=False)

    def share_prefix(self, seq_id: str, tokens: list[int], limit: int, batch: set[str]) -> SlotMove | None:
        """Give seq_id, which has no cache, the longest prefix of `tokens` (at most `limit`
        positions, and at least MIN_SHARED_PREFIX) that a cached sequence holds. A retired
        donor's slot becomes seq_id's; a running donor's prefix must be copied into the slot
        taken here (the returned move, to make before the next forward pass). None: no donor."""
        donor, length = self._longest_prefix(tokens, limit)
        if donor is None:
            return None
        self.shared_positions += length
        if isinstance(donor, Retired):
            entry = self._entries.pop(donor)
            self._tokens -= len(entry) - length
            entry.tokens = tokens[:length]
            self._entries[seq_id] = entry
            return None
        source = self._entries[donor].slot
        slot = self._take_slot(near=[source], batch=batch | {donor})
        self._entries[seq_id] = CachedSequence(tokens[:length], slot)
        self._tokens += length
        return SlotMove(source, slot, length)

    def _longest_prefix(self, tokens: list[int], limit: int) -> tuple[str | Retired | None, int]:
        limit = min(limit, len(tokens))
        if limit < MIN_SHARED_PREFIX:
            return None, 0
        head = tokens[:MIN_SHARED_PREFIX]
        best, longest = None, MIN_SHARED_PREFIX - 1
        for key, entry in self._entries.items():
            if entry.tokens[:MIN_SHARED_PREFIX] == head:    # most entries end here, in C
                length = min(common_prefix_length(entry.tokens, tokens), limit)
                if length > longest:
                    best, longest = key, length
        return best, longest

    def abandon(self, slot: int) -> None:
        """A slot `place` gave out whose forward pass failed: free, its contents unknown."""
        heapq.heappush(self._free, slot)

    def clear(self) -> None:
        """Forget every sequence: all slots free."""
        self._entries.clear()
        self._free = list(range(1, self.capacity + 1))
        self._tokens = 0

    def drop(self, seq_id: str) -> None:
        entry = self._entries.pop(seq_id, None)
        if entry is not None:
            self._release(entry)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def retired(self) -> int:
        return sum(isinstance(key, Retired) for key in self._entries)

    def _release(self, entry: CachedSequence) -> None:
        self._tokens -= len(entry)
        heapq.heappush(self._free, entry.slot)

    def _take_slot(self, near, batch: set[str]) -> int:
        """A free slot, the nearest to the batch's others; else the least recently used
        sequence's (never one of the batch's) once the slot budget is spent; else a new one."""
        anchors = list(near)
        if self._free:
            best = min(self._free, key=lambda s: min((abs(s - a) for a in anchors), default=s))
            self._free.remove(best)
            heapq.heapify(self._free)
            return best
        if self.capacity >= self.max_slots:
            victim = next((s for s in self._entries if s not in batch), None)
            if victim is not None:
                entry = self._entries.pop(victim)
                self._tokens -= len(entry)
                self.evictions += 1
                return entry.slot
        return self._new_slot()

    def _new_slot(self) -> int:
        self.capacity += 1
        return self.capacity

    def _gather(self, slots: dict[str, int], reuse: dict[str, int]) -> list[SlotMove]:
        """Move the batch into the run of adjacent slots that already holds most of it.
        Cached sequences in the way move to free or new slots outside it (or are evicted);
        then the batch's outliers move in. Returns the copies, in the order to make them."""
        width = len(slots)
        self.capacity = max(self.capacity, width)
        taken = set(slots.values())
        start = max(range(1, self.capacity - width + 2),
                    key=lambda a: sum(a <= s < a + width for s in taken))
        run = set(range(start, start + width))
        moves: list[SlotMove] = []
        outside_free = [s for s in self._free if s not in run]
        for seq_id, entry in list(self._entries.items()):
            if entry.slot not in run:
                continue
            if outside_free or self.capacity < self.max_slots:
                destination = outside_free.pop() if outside_free else self._new_slot()
                moves.append(SlotMove(entry.slot, destination, len(entry)))
                if destination in self._free:
                    self._free.remove(destination)
                entry.slot = destination
            else:
                del self._entries[seq_id]
                self._tokens -= len(entry)
                self.evictions += 1
        self._free = [s for s in self._free if s not in run]
        vacant = sorted(run - taken)
        for seq_id, slot in slots.items():
            if slot not in run:
                destination = vacant.pop(0)
                if reuse.get(seq_id, 0) > 0:
                    moves.append(SlotMove(slot, destination, reuse[seq_id]))
                self._free.append(slot)
                slots[seq_id] = destination
        heapq.heapify(self._free)
        self.moves += len(moves)
        return moves
