"""Caches in preallocated slots, read in place: whatever the batches, evictions, moves and
divergences, every call's logits equal the model's own forward over the call's whole token
list (computed without any cache), and a batch whose members stay the same copies nothing."""

from __future__ import annotations

import random

import torch

from replicas.engines.huggingface.kv_cache import KVCacheStore, tolerated_span
from replicas.engines.huggingface.kv_storage import BatchWindow, layout_rows
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from training.tiny_models import tiny_llama

VOCAB = 64


def reference_logits(model, tokens: list[int], wanted: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -wanted:].float()


def test_random_batches_evictions_moves_and_divergences_match_the_uncached_model():
    model = tiny_llama("target", VOCAB, eos_token_id=0, seed=5)
    rng = random.Random(1)
    # 6 slots of 48 positions for 10 sequences: sequences are evicted, slots reused and moved.
    runner = ModelRunner(model, max_cached_tokens=6 * 48, max_seq_len=48)
    sequences = {f"s{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 12))] for i in range(10)}
    for step in range(30):
        chosen = rng.sample(sorted(sequences), rng.randrange(1, 7))
        calls = []
        for seq_id in chosen:
            tokens = sequences[seq_id]
            if len(tokens) > 30 or rng.random() < 0.2:          # diverge well before the end
                del tokens[rng.randrange(1, len(tokens)):]
            tokens.extend(rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 6)))
            calls.append(ExtendCall(seq_id, list(tokens), rng.randrange(1, min(4, len(tokens)) + 1)))
        if rng.random() < 0.2:
            runner.release(rng.choice(sorted(sequences)))
        for call, result in zip(calls, runner.extend_batch(calls), strict=True):
            expected = reference_logits(model, call.tokens, call.num_logits)
            torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    store = runner.caches
    assert store.evictions > 0 and store.moves > 0          # both paths were taken
    assert len(store) <= store.max_slots and store.cached_tokens <= store.max_tokens
    # Every slot is either free or held by exactly one sequence: none leaked, none shared.
    held = [entry.slot for entry in store._entries.values()]
    assert sorted(held + store._free) == list(range(1, store.capacity + 1))


def test_a_batch_with_holes_leaves_the_holes_caches_intact():
    model = tiny_llama("target", VOCAB, eos_token_id=0, seed=6)
    runner = ModelRunner(model, max_cached_tokens=8 * 32, max_seq_len=32)
    tokens = {f"s{i}": [i + 1, i + 2, i + 3, i + 4] for i in range(4)}
    runner.extend_batch([ExtendCall(s, t, 1) for s, t in tokens.items()])     # slots 1..4
    slots = {s: runner.caches.get(s).slot for s in tokens}
    assert sorted(slots.values()) == [1, 2, 3, 4]
    # s0 and s3 alone: their window spans s1's and s2's slots, which it must not touch.
    ends = [ExtendCall(s, tokens[s] + [9, 10], 2) for s in ("s0", "s3")]
    for call, result in zip(ends, runner.extend_batch(ends)):
        torch.testing.assert_close(result.logits, reference_logits(model, call.tokens, 2), atol=1e-4, rtol=1e-4)
        assert result.positions_fed == 2
    assert runner.caches.moves == 0
    assert (runner.caches.sequence_rows, runner.caches.window_rows) == (4 + 2, 4 + 4)   # two holes computed
    for seq_id in ("s1", "s2"):
        result = runner.extend(seq_id, tokens[seq_id] + [11], 1)
        assert result.positions_fed == 1                       # its cache was kept, and is right
        torch.testing.assert_close(result.logits, reference_logits(model, tokens[seq_id] + [11], 1),
                                   atol=1e-4, rtol=1e-4)


def test_steady_batches_read_the_storage_in_place():
    model = tiny_llama("target", VOCAB, eos_token_id=0, seed=7)
    runner = ModelRunner(model, max_cached_tokens=8 * 64, max_seq_len=64)
    tokens = {f"s{i}": [i + 1] * 5 for i in range(8)}
    runner.extend_batch([ExtendCall(s, t, 1) for s, t in tokens.items()])
    storage = [tensor.data_ptr() for layer in runner.storage.layers for tensor in layer]
    for step in range(10):
        for t in tokens.values():
            t.extend([step + 2, step + 3])
        results = runner.extend_batch([ExtendCall(s, list(t), 3) for s, t in tokens.items()])
        assert {r.positions_fed for r in results} == {3} and {r.batch_rows for r in results} == {8}
    assert [tensor.data_ptr() for layer in runner.storage.layers for tensor in layer] == storage
    assert runner.caches.moves == 0
    # What attention gets is a view of the storage, not a copy of the rows' caches.
    stored_keys, stored_values = runner.storage.layers[0]
    layout, _, _ = layout_rows(1, [len(t) for t in tokens.values()], [1] * 8, torch.device("cpu"))
    with torch.inference_mode():
        new = stored_keys.new_zeros(8, stored_keys.shape[1], 1, stored_keys.shape[3])
    with torch.inference_mode():
        keys, values = BatchWindow(runner.storage, layout).update(new, new, 0)
    assert keys.untyped_storage().data_ptr() == stored_keys.untyped_storage().data_ptr()
    assert values.untyped_storage().data_ptr() == stored_values.untyped_storage().data_ptr()


def test_a_spread_out_batch_is_moved_together_once():
    store = KVCacheStore(max_tokens=20 * 10, max_seq_len=10)
    for i in range(12):
        slots, _ = store.place([f"s{i}"], {})
        store.commit(f"s{i}", [1, 2, 3], slots[f"s{i}"])
    batch = ["s0", "s5", "s11"]                                # slots 1, 6, 12: a span of 12
    slots, moves = store.place(batch, {s: 3 for s in batch})
    assert max(slots.values()) - min(slots.values()) + 1 <= tolerated_span(3)
    assert moves and all(move.length == 3 for move in moves)
    for seq_id in batch:
        store.commit(seq_id, [1, 2, 3], slots[seq_id])
    held = [store.get(f"s{i}").slot for i in range(12)]
    assert len(set(held)) == 12                                # no two sequences share a slot
    _, again = store.place(batch, {s: 3 for s in batch})
    assert again == []                                         # together now: no more moves
