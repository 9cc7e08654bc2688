"""One causal LM, the KV caches of the sequences it has seen, and batched forward passes.

Every call carries a sequence's full token ids, so a cache is only ever a shortcut: the
runner reuses the longest common prefix of what it holds and what it is asked for, and
computes the rest. A replica that never saw the sequence, or evicted it, computes more and
returns the same logits.

Caches live in preallocated slots (replicas/engines/huggingface/kv_cache.py, replicas/engines/huggingface/kv_storage.py): a
sequence's keys and values stay where its forward passes wrote them, and a batch reads them
in place. The calls of one `extend_batch` run as one forward pass (or a few, see
`_padding_groups`) over the window of adjacent slots that holds their rows:

    row r (slot lo + r):  [ cached P_r ][ new N_r | right padding ]     holes: [ padding ]
                          <-- in the slot --><------- N ------->

RoPE positions are per row (P_r + j). Right padding and holes write to the scratch slot and
their outputs are discarded; by causality no real position sees them. Only the positions
whose logits a call wants go through the output layer, and the logits stay on the model's
device: the engines take from them only what the acceptance rule needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from replicas.engines.huggingface.cuda_graphs import Capture, CudaGraphCapture, GraphedForward
from replicas.engines.huggingface.fused_cpu import FusedCpuForward, load_library
from replicas.engines.huggingface.kv_cache import KVCacheStore, common_prefix_length
from replicas.engines.huggingface.kv_storage import BatchWindow, SlotStorage, layout_rows
from replicas.engines.huggingface.llama_forward import LlamaForward

logger = logging.getLogger("ray.serve")

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
    logits: torch.Tensor   # [num_logits, V], float32, on the model's device, for the last num_logits positions
    positions_fed: int     # positions computed for this sequence
    batch_rows: int        # sequences in the forward pass that computed it
    batch_positions: int   # positions that forward pass computed, over all its sequences


class ModelRunner:
    def __init__(self, model: PreTrainedModel, max_cached_tokens: int, max_seq_len: int | None = None,
                 lean: bool = True, compiled: bool = False, prefix_caching: bool = True,
                 fused_cpu: bool = False, fused_cache_dir: Path | None = None, prefill_chunk: int | None = None,
                 row_block: int | None = None, cuda_graphs: bool = False):
        """lean: run a plain Llama decoder through LlamaForward (the same arithmetic with far
        less Python per call); other models, or lean=False, run through their own modules.
        prefix_caching: a new sequence takes the longest prefix of its tokens that any cached
        sequence holds, and a finished one (`retire`) stays cached to give it (kv_cache.py).
        compiled: LlamaForward's layers compiled (llama_forward.py), each shape class compiled
        here, before the first call; where that fails, eager with a warning.
        fused_cpu: a float32 plain Llama on a CPU runs as one C call a step (fused_cpu.py; its
        library built into fused_cache_dir), eager where that does not apply or cannot be built.
        prefill_chunk: the most new positions a sequence computes in one forward pass; a longer
        prefill runs in chunks of it (chunked prefill), each extending the cache the next one
        reuses, so a long prompt's activations stay bounded. None: whole.
        row_block: LlamaForward's linears and norms this many rows at a time (RowBlockLinear: a
        GPU's kernels then sum every position the same way in any call). None: whole.
        cuda_graphs: on a GPU, the eager lean forward's decode and verify passes replayed from
        CUDA graphs (cuda_graphs.py); other passes, and other models, eager."""
        _check_plain_output_layer(model.config)
        self.model = model
        self.decoder = (LlamaForward(model, row_block=row_block) if lean and LlamaForward.supports(model)
                        else self._module_decoder)
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.pad_id = model.config.pad_token_id or 0
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        self.caches = KVCacheStore(max_cached_tokens, self.max_seq_len)
        self.storage = SlotStorage(self.max_seq_len)
        self.compile_s: float | None = None      # how long compiling took, where it ran
        self.prefix_caching = prefix_caching
        self.prefill_chunk = prefill_chunk
        self.widest_pass = 0                     # the most new positions a row computed in one pass
        if compiled:
            self._compile()
        elif cuda_graphs:     # before the fused forward: `compile: auto` asks for both, each for its device
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
            self.replay_graphs(CudaGraphCapture())
        elif fused_cpu and self.lean:
            self._fuse(fused_cache_dir)

    def replay_graphs(self, capture: Capture) -> None:
        """Run the eager lean forward's passes that fit a bucket as graphs `capture` makes
        (cuda_graphs.py); the KV storage is allocated whole now, since a graph holds its
        addresses. A tensor-parallel shard's all-reduce hooks, or another model, stay eager."""
        if not isinstance(self.decoder, LlamaForward) or any(layer.hooked for layer in self.decoder.layers):
            logger.warning("CUDA graphs apply to a plain Llama decoder in one process; this one runs eager")
            return
        self.storage.ensure_capacity(self.caches.max_slots)
        self.decoder = GraphedForward(self.decoder, self.storage, self.pad_id, capture)

    def _fuse(self, cache_dir: Path | None) -> None:
        if not FusedCpuForward.supports(self.model):
            return
        library = load_library(cache_dir)
        if library is not None:
            self.decoder = FusedCpuForward(self.model, library, self.max_seq_len)

    def _compile(self) -> None:
        if not self.lean:
            logger.warning("compile: on: %s is not a plain Llama decoder; it runs eager", type(self.model).__name__)
            return
        started = time.perf_counter()
        eager, self.decoder = self.decoder, LlamaForward(self.model, compiled=True)
        try:
            self.warm_up()
        except Exception:  # noqa: BLE001 - any compiler failure: eager computes the same thing
            logger.warning("compile: on: compiling failed; this replica runs eager", exc_info=True)
            self.decoder = eager
            self.caches.clear()
            return
        self.compile_s = time.perf_counter() - started
        logger.info("compiled the forward's shape classes in %.1f s", self.compile_s)

    def warm_up(self) -> None:
        """A forward pass of each shape class the compiler tells apart in serving (one row or
        several; a prefill, one new position on a cache, several on a cache as a verify), so
        that none is compiled during a client's request; its caches are released after."""
        warm = [[f"warm-up-{rows}-{r}" for r in range(rows)] for rows in (1, 2)]
        for seq_ids in warm:
            for length in (3, 4, 7):    # a prefill of 3 positions, 1 new position on top, then 3
                self.extend_batch([ExtendCall(seq_id, [self.pad_id] * length, 1) for seq_id in seq_ids])
        for seq_ids in warm:
            for seq_id in seq_ids:
                self.release(seq_id)

    def extend(self, seq_id: str, tokens: list[int], num_logits: int) -> Extension:
        """Make seq_id's cache cover `tokens`; return logits of its last num_logits positions.
        Position j's logits predict token j + 1."""
        return self.extend_batch([ExtendCall(seq_id, tokens, num_logits)])[0]

    @torch.inference_mode()
    def extend_batch(self, calls: list[ExtendCall]) -> list[Extension]:
        for call in calls:
            if not 1 <= call.num_logits <= len(call.tokens) <= self.max_seq_len:
                raise ValueError(f"a call of {len(call.tokens)} tokens wanting {call.num_logits} logits does not fit "
                                 f"this model's {self.max_seq_len} positions")
        if self.prefill_chunk:
            self._prefill_in_chunks(calls)
        return self._extend_whole(calls)

    def _extend_whole(self, calls: list[ExtendCall]) -> list[Extension]:
        results: list[Extension | None] = [None] * len(calls)
        for wave in _distinct_sequences(calls):
            if self.prefix_caching:
                self._share_prefixes([calls[i] for i in wave])
            planned = [self._reusable(calls[i]) for i in wave]
            # The fused forward skips padding (it computes real tokens only): one pass, not one
            # per padding group, whose every pass reads all the weights again.
            groups = [list(range(len(wave)))] if self.fused else \
                _padding_groups([len(calls[i].tokens) - p for i, p in zip(wave, planned)])
            for group in groups:
                indices = [wave[g] for g in group]
                for i, extension in zip(indices, self._run([calls[i] for i in indices])):
                    results[i] = extension
        return results

    def _prefill_in_chunks(self, calls: list[ExtendCall]) -> None:
        """Bring every call within prefill_chunk new positions: calls with more run first as
        calls of their leading tokens, a chunk at a time, together (their logits unused)."""
        chunk, left = self.prefill_chunk, {}
        while True:
            ahead = {}
            for call in calls:
                new = len(call.tokens) - self._reusable(call)
                # (a cache evicted in between makes no progress: that call then runs whole)
                if chunk < new < left.get(call.seq_id, new + 1) and call.seq_id not in ahead:
                    ahead[call.seq_id] = ExtendCall(call.seq_id, call.tokens[:len(call.tokens) - new + chunk], 1)
                    left[call.seq_id] = new
            if not ahead:
                return
            self._extend_whole(list(ahead.values()))

    def release(self, seq_id: str) -> None:
        """Forget the sequence's cache (a probe's, or one that may hold bad numbers)."""
        self.caches.drop(seq_id)

    def retire(self, seq_id: str) -> None:
        """The sequence has finished: with prefix caching its cache stays for later sequences
        that begin the same way, else it is forgotten."""
        if self.prefix_caching:
            self.caches.retire(seq_id)
        else:
            self.caches.drop(seq_id)

    def _share_prefixes(self, calls: list[ExtendCall]) -> None:
        """Calls of sequences without a cache start from another sequence's common prefix,
        copied into place before the forward pass that computes the rest."""
        batch = {call.seq_id for call in calls}
        for call in calls:
            if call.seq_id in self.caches:
                continue
            move = self.caches.share_prefix(call.seq_id, call.tokens, len(call.tokens) - call.num_logits, batch)
            if move is not None:
                self.storage.ensure_capacity(self.caches.capacity, self.caches.max_slots)
                self.storage.move([move])

    def cached(self, seq_id: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The sequence's cached keys and values per layer, [1, kv_heads, len, head_dim] views."""
        entry = self.caches.get(seq_id)
        return None if entry is None else self.storage.sequence(entry.slot, len(entry))

    def _reusable(self, call: ExtendCall) -> int:
        """Cached positions the call can keep: its common prefix with the cache, leaving at
        least the positions whose logits it wants to be computed."""
        entry = self.caches.get(call.seq_id)
        if entry is None:
            return 0
        return max(0, min(common_prefix_length(entry.tokens, call.tokens), len(call.tokens) - call.num_logits))

    def _run(self, calls: list[ExtendCall]) -> list[Extension]:
        reuse = {call.seq_id: self._reusable(call) for call in calls}   # again: an earlier group may have evicted
        slots, moves = self.caches.place([call.seq_id for call in calls], reuse)
        try:
            self.storage.ensure_capacity(self.caches.capacity, self.caches.max_slots)
            self.storage.move(moves)
        except BaseException:
            self.caches.clear()   # the index already points moved sequences at their new slots
            raise
        try:
            extensions = self._forward(calls, reuse, slots)
        except BaseException:
            for slot in slots.values():   # a half-written slot must never be reused
                self.caches.abandon(slot)
            raise
        for call in calls:
            self.caches.commit(call.seq_id, call.tokens, slots[call.seq_id])
        reused = sum(reuse.values())
        self.caches.count_forward(reused, sum(len(call.tokens) for call in calls) - reused)
        self.caches.count_rows(len(calls), max(slots.values()) - min(slots.values()) + 1)
        return extensions

    def _forward(self, calls: list[ExtendCall], reuse: dict[str, int], slots: dict[str, int]) -> list[Extension]:
        lo = min(slots.values())
        rows = max(slots.values()) - lo + 1
        cached, new = [0] * rows, [0] * rows                     # P_r, N_r; holes keep 0, 0
        for call in calls:
            r = slots[call.seq_id] - lo
            cached[r], new[r] = reuse[call.seq_id], len(call.tokens) - reuse[call.seq_id]
        self.widest_pass = max(self.widest_pass, max(new))
        input_ids = torch.full((rows, max(new)), self.pad_id, dtype=torch.long)          # [R, N]
        for call in calls:
            r = slots[call.seq_id] - lo
            input_ids[r, :new[r]] = torch.tensor(call.tokens[cached[r]:])
        layout, positions, mask = layout_rows(lo, cached, new, self.device)
        hidden = self.decoder(input_ids.to(self.device), positions, mask, BatchWindow(self.storage, layout))  # [R, N, hidden]
        wanted_rows, wanted_columns = [], []
        for call in calls:
            r = slots[call.seq_id] - lo
            wanted_rows += [r] * call.num_logits
            wanted_columns += range(new[r] - call.num_logits, new[r])
        picked = hidden[torch.tensor(wanted_rows, device=self.device), torch.tensor(wanted_columns, device=self.device)]
        logits = self._output_layer(picked).float()                                  # [sum num_logits, V]
        batch_positions = sum(len(call.tokens) - reuse[call.seq_id] for call in calls)
        per_call = logits.split([call.num_logits for call in calls])
        return [Extension(rows_logits, positions_fed=len(call.tokens) - reuse[call.seq_id], batch_rows=len(calls),
                          batch_positions=batch_positions) for call, rows_logits in zip(calls, per_call)]

    def _module_decoder(self, input_ids, positions, mask, window: BatchWindow) -> torch.Tensor:
        if self.model.config._attn_implementation != "sdpa":     # eager attention adds its mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min)
        return self.model.get_decoder()(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                                        cache=window, use_cache=True).last_hidden_state

    def _output_layer(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = getattr(self.decoder, "logits", None)    # the fused forward's own, row by row
        return logits(hidden) if logits is not None else self.model.get_output_embeddings()(hidden)

    @property
    def lean(self) -> bool:
        """A plain Llama decoder run by this project's forward (eager, compiled, fused or graphed)."""
        return isinstance(self.decoder, (LlamaForward, FusedCpuForward, GraphedForward))

    @property
    def graph_counts(self) -> dict | None:
        """CUDA graphs captured, replayed, dropped, and passes run eager past every bucket; None without graphs."""
        return self.decoder.counts if isinstance(self.decoder, GraphedForward) else None

    @property
    def fused(self) -> bool:
        return isinstance(self.decoder, FusedCpuForward)


def _check_plain_output_layer(config) -> None:
    """The runner applies the output layer itself, to the wanted positions only: a model that
    scales or caps its logits after it would get different ones."""
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"models with {name} are not supported by the Hugging Face engine")


def _distinct_sequences(calls: list[ExtendCall]) -> list[list[int]]:
    """Indices of calls in waves that each hold a sequence once: two calls of one sequence
    would share its slot, so the later one runs after the earlier one."""
    waves: list[list[int]] = []
    seen: list[set[str]] = []
    for i, call in enumerate(calls):
        wave = next((w for w, ids in enumerate(seen) if call.seq_id not in ids), len(waves))
        if wave == len(waves):
            waves.append([]), seen.append(set())
        waves[wave].append(i)
        seen[wave].add(call.seq_id)
    return waves


def _padding_groups(new_lengths: list[int]) -> list[list[int]]:
    """Indices of rows, grouped by new length so that padding stays within _MAX_PADDING_FACTOR."""
    order = sorted(range(len(new_lengths)), key=lambda i: new_lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        n = new_lengths[i]
        if current and (len(current) + 1) * n > _MAX_PADDING_FACTOR * (real + n):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        groups.append(current)
    return groups
