"""A GGUF model in one llama.cpp context that holds many sequences, driven through
llama-cpp-python's low-level API: the same `extend_batch` the Hugging Face engine's runner
offers (replicas/engines/huggingface/model_runner.py), so the draft and target engines on top
(engine.py there: drafting, the acceptance rule, logprobs, grammars) are the same code on
either engine, and both are exact the same way.

Terms:
- slot: a llama.cpp sequence id (0 .. n_seq_max - 1). Each sequence specserve names holds one
  while its positions are in the context's KV cache.
- held tokens: what a slot's cache holds, positions 0 .. len - 1.
- the unified KV cache (llama.cpp's kv_unified): one pool of n_ctx cells that every slot draws
  from, so a sequence may grow to the model's context while others are short, and a prefix is
  shared between slots by reference (llama_memory_seq_cp tags the same cells with both ids).

Every call carries a sequence's full token ids: a slot keeps the longest prefix it shares with
them (and at least its last num_logits positions are computed again, since llama.cpp keeps no
logits for past positions), drops the rest (rejected drafts), and the new positions of every
call of a batch run as one llama_decode. A sequence new to the runner first shares the
longest prefix a held or retired sequence has with it. When the cache is full, retired
sequences go first, then the least recently used that are not in the batch.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from replicas.engines.huggingface.model_runner import ExtendCall, Extension

logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)   # llama.cpp's load chatter, before its import
import llama_cpp  # noqa: E402

logger = logging.getLogger("ray.serve")

KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
_MAX_SLOTS = 256          # llama.cpp's LLAMA_MAX_SEQ
_CONTEXT_BATCH = 512      # the context's n_batch and n_ubatch
# Positions per llama_decode: below llama.cpp's CPU flash attention's query tile (64), where it
# switches to a tiled kernel that sums in another order (see _decode_piece).
_DECODE_TOKENS = 63
# Finished sequences kept for their prefixes. llama.cpp's attention visits every cell up to the
# highest one in use (its n_kv), masked or not, for each new position of a pass, so every cell
# kept for a finished sequence makes each later pass longer whatever its rows. A few hold a
# shared prefix (a system prompt, a chat's earlier turns) as well as many.
RETIRED_KEPT = 8


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model, a context or a batch."""


@dataclass
class _Held:
    slot: int
    tokens: list[int] = field(default_factory=list)
    retired: bool = False      # finished: kept only to give its prefix to new sequences


class LlamaCppRunner:
    def __init__(self, gguf: Path, max_cached_tokens: int, max_seq_len: int, max_sequences: int = 64,
                 threads: int = 1, kv_type: str = "f16", prefix_caching: bool = True, gpu_layers: int = -1,
                 repack: bool = False, flash_attention: bool = True, retired_kept: int = RETIRED_KEPT,
                 lone_step_window: bool = True):
        """max_cached_tokens: the unified KV cache's cells over all sequences; max_sequences:
        the slots (at most 256); threads: llama.cpp's threads for every pass (the replica's
        CPUs); kv_type: the cache's element type; gpu_layers: layers offloaded where the build
        has a GPU backend (-1: all; a CPU build ignores it); repack: llama.cpp's repacked weight
        layouts for the CPU (its extra buffer types: AMX, AVX-512 and ARM kernels), which
        crashed the process on a Q8_0 model's first pass here (an Intel Xeon with AMX, 2026-12);
        flash_attention: llama.cpp's fused attention (llama-server's default on CPUs), whose
        results do not depend on the pass below 64 positions (_decode_piece), at the cost of
        precision: on the CPU it scores in half precision, logits about 1e-3 from float32's.
        Without it attention is float32 throughout, and a position's logits change with the
        pass (by about 3e-4 here): exact speculation needs it on. retired_kept: finished
        sequences whose cells stay for later prefixes (RETIRED_KEPT). lone_step_window: a
        lone single-token step runs as a window of two (_step_as_window), as a target's
        exactness needs; off for drafts (their numbers need only be their own: the rule takes
        q from the same pass) and to measure what it costs (cluster/bench/llamacpp_passes.py --lone)."""
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        params.use_extra_bufts = repack
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise LlamaCppError(f"llama.cpp could not load {gguf}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.max_seq_len = max_seq_len
        self.max_tokens = max(max_cached_tokens, max_seq_len)
        self.threads, self.kv_type, self.prefix_caching = threads, kv_type, prefix_caching
        self.flash_attention, self.retired_kept = flash_attention, retired_kept
        self.lone_step_window = lone_step_window
        self.context = self._new_context(min(_MAX_SLOTS, max(2, max_sequences)))
        self.memory = llama_cpp.llama_get_memory(self.context)
        self.device = torch.device("cpu")        # where the logits it returns live
        self._held: OrderedDict[str, _Held] = OrderedDict()   # least recently used first
        self._free = list(range(llama_cpp.llama_n_seq_max(self.context)))[::-1]
        self.evictions = self.reused_positions = self.computed_positions = self.shared_positions = 0

    def _new_context(self, slots: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.max_tokens
        params.n_batch = params.n_ubatch = _CONTEXT_BATCH
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attention
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.n_seq_max = slots
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = KV_TYPES[self.kv_type]
        params.no_perf = True
        context = llama_cpp.llama_init_from_model(self.model, params)
        if not context:
            raise LlamaCppError(f"llama.cpp could not make a context of {self.max_tokens} cells and {slots} sequences")
        return context

    # --- the Runner interface (replicas/engines/huggingface/engine.py) ---

    def extend_batch(self, calls: list[ExtendCall]) -> list[Extension]:
        """Each call's sequence extended to its tokens in one batched pass (in pieces of
        _DECODE_TOKENS positions), the logits of its last num_logits positions returned."""
        names = {call.seq_id for call in calls}
        plans = [self._prepare(call, names) for call in calls]     # (slot, first new position)
        lone_step = len(calls) == 1 and len(calls[0].tokens) - plans[0][1] == 1 and plans[0][1] > 0
        if lone_step and self.lone_step_window:
            plans = [self._step_as_window(calls[0], *plans[0])]
        new = [len(call.tokens) - start for call, (_, start) in zip(calls, plans)]
        self._make_room(sum(new), names)
        entries = [(slot, call.tokens[p], p, p >= len(call.tokens) - call.num_logits)
                   for call, (slot, start) in zip(calls, plans) for p in range(start, len(call.tokens))]
        try:
            logits = self._decode(entries)
        except Exception:
            for name in names:        # a piece that failed leaves their caches unknown
                self.release(name)
            raise
        extensions, at = [], 0
        for call, fed in zip(calls, new):
            self._held[call.seq_id].tokens = list(call.tokens)
            extensions.append(Extension(torch.from_numpy(logits[at:at + call.num_logits]), fed, len(calls), len(entries)))
            at += call.num_logits
        self.computed_positions += len(entries)
        return extensions

    def release(self, seq_id: str) -> None:
        """Forget the sequence's positions."""
        held = self._held.pop(seq_id, None)
        if held is not None:
            llama_cpp.llama_memory_seq_rm(self.memory, held.slot, -1, -1)
            self._free.append(held.slot)

    def retire(self, seq_id: str) -> None:
        """The sequence finished: its positions stay, first to go, to give a new sequence its
        prefix; beyond the retired_kept latest, the oldest retired sequence goes now."""
        if not self.prefix_caching:
            self.release(seq_id)
        elif seq_id in self._held:
            self._held[seq_id].retired = True
            self._held.move_to_end(seq_id, last=False)      # the front: retired, latest first
            retired = [name for name, held in self._held.items() if held.retired]
            for name in retired[self.retired_kept:]:
                self.release(name)
                self.evictions += 1

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._held

    def describe(self) -> dict:
        live = [h for h in self._held.values() if not h.retired]
        return {"engine": "llamacpp", "threads": self.threads, "kv_type": self.kv_type,
                "lone_step_window": self.lone_step_window,
                "cached_sequences": len(live), "retired_sequences": len(self._held) - len(live),
                "cached_tokens": sum(len(h.tokens) for h in self._held.values()), "max_cached_tokens": self.max_tokens,
                "kv_slots": len(self._held), "max_kv_slots": llama_cpp.llama_n_seq_max(self.context),
                "evictions": self.evictions, "reused_positions": self.reused_positions,
                "computed_positions": self.computed_positions, "shared_prefix_positions": self.shared_positions}

    def token_text(self, token: int) -> str:
        return llama_cpp.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self.context:
            llama_cpp.llama_free(self.context)
            self.context = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    # --- slots and the cache ---

    def _prepare(self, call: ExtendCall, batch: set[str]) -> tuple[int, int]:
        """The call's slot, its cache cut to what it shares with the call's tokens (and to
        before the positions whose logits are wanted); returns (slot, first position to compute)."""
        if not 1 <= call.num_logits <= len(call.tokens):
            raise ValueError(f"num_logits {call.num_logits} for {len(call.tokens)} tokens")
        if len(call.tokens) > self.max_seq_len:
            raise ValueError(f"{len(call.tokens)} tokens exceed the context of {self.max_seq_len}")
        held = self._held.get(call.seq_id)
        if held is None:
            held = self._take_slot(call.seq_id, batch)
            self._share_prefix(held, call.tokens)
        self._held.move_to_end(call.seq_id)
        held.retired = False
        keep = min(_common_prefix(held.tokens, call.tokens), len(call.tokens) - call.num_logits)
        if keep < len(held.tokens):
            llama_cpp.llama_memory_seq_rm(self.memory, held.slot, keep, -1)
            held.tokens = held.tokens[:keep]
        self.reused_positions += keep
        return held.slot, keep

    def _step_as_window(self, call: ExtendCall, slot: int, start: int) -> tuple[int, int]:
        """A pass of one position runs as a window of two, its position before computed again
        (the same keys and values): llama.cpp multiplies a single position by a
        matrix-vector path and two or more by its matrix-matrix kernels, which sum in another
        order, while every pass of 2 to 63 positions gives each position the same logits
        whatever else it holds (tests/test_llamacpp_engine.py). So the target alone's single
        steps and a verify's windows compute the same numbers, as exact speculation needs."""
        llama_cpp.llama_memory_seq_rm(self.memory, slot, start - 1, -1)
        self._held[call.seq_id].tokens = list(call.tokens[:start - 1])
        return slot, start - 1

    def _take_slot(self, seq_id: str, batch: set[str]) -> _Held:
        if not self._free:
            self._evict_one(batch)
        held = _Held(self._free.pop())
        self._held[seq_id] = held
        return held

    def _share_prefix(self, held: _Held, tokens: list[int]) -> None:
        """A new sequence's cache starts as the longest prefix any held sequence shares with
        it: the cells are tagged with its slot too, not copied."""
        if not self.prefix_caching:
            return
        best, length = None, 0
        for other in self._held.values():
            if other is not held:
                shared = _common_prefix(other.tokens, tokens)
                if shared > length:
                    best, length = other, shared
        if best is not None:
            llama_cpp.llama_memory_seq_cp(self.memory, best.slot, held.slot, 0, length)
            held.tokens = tokens[:length]
            self.shared_positions += length

    def _make_room(self, new_positions: int, batch: set[str]) -> None:
        """Evict until the held positions and the batch's new ones fit the cache (held
        positions counted as if none were shared: room is never overestimated)."""
        while sum(len(h.tokens) for h in self._held.values()) + new_positions > self.max_tokens:
            if not self._evict_one(batch, required=False):
                return

    def _evict_one(self, batch: set[str], required: bool = True) -> bool:
        """The first retired sequence, else the least recently used one outside the batch."""
        order = sorted(self._held.items(), key=lambda item: not item[1].retired)   # stable: LRU within each
        for seq_id, _ in order:
            if seq_id not in batch:
                self.release(seq_id)
                self.evictions += 1
                return True
        if required:
            raise LlamaCppError(f"a batch of {len(batch)} sequences exceeds the context's "
                                f"{llama_cpp.llama_n_seq_max(self.context)} sequence slots")
        return False

    # --- decoding ---

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Run (slot, token, position, wants logits) entries through llama_decode in order, in
        pieces; the wanted logits [n, V] as float32, in the entries' order."""
        wanted = sum(entry[3] for entry in entries)
        out = np.empty((wanted, self.vocab_size), dtype=np.float32)
        row = 0
        for piece in _pieces(entries):
            self._decode_piece(piece)
            count = sum(entry[3] for entry in piece)
            if count:
                pointer = llama_cpp.llama_get_logits(self.context)
                out[row:row + count] = np.ctypeslib.as_array(pointer, shape=(count * self.vocab_size,)).reshape(
                    count, self.vocab_size)
                row += count
        return out

    def _decode_piece(self, piece: list[tuple[int, int, int, bool]]) -> None:
        batch = llama_cpp.llama_batch_init(len(piece), 0, 1)
        try:
            for i, (slot, token, position, logits) in enumerate(piece):
                batch.token[i] = token
                batch.pos[i] = position
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = slot
                batch.logits[i] = logits
            batch.n_tokens = len(piece)
            status = llama_cpp.llama_decode(self.context, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        if status != 0:
            raise LlamaCppError(f"llama_decode returned {status} for {len(piece)} positions "
                                f"({'no room in the KV cache' if status == 1 else 'an error'})")


def _pieces(entries: list) -> list[list]:
    """The entries in as few pieces of at most _DECODE_TOKENS as can be, of sizes as equal as
    can be: none of one position where there are more (a single position sums in another
    order, _step_as_window)."""
    count = -(-len(entries) // _DECODE_TOKENS)
    size, extra = divmod(len(entries), max(count, 1))
    pieces, at = [], 0
    for index in range(count):
        length = size + (index < extra)
        pieces.append(entries[at:at + length])
        at += length
    return pieces


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def threads_for(num_cpus: float) -> int:
    """llama.cpp's threads for a replica that reserved num_cpus (at least one)."""
    return max(1, math.ceil(num_cpus))

