"""Prefix caching (replicas/engines/huggingface/kv_cache.py): a new sequence starts from the
longest prefix of its tokens that a finished or running sequence's cache holds, computes only
the rest, and gets the logits a runner that never saw the prefix computes."""

from __future__ import annotations

import pytest
import torch

from replicas.engines.huggingface.kv_cache import MIN_SHARED_PREFIX, KVCacheStore
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from training.tiny_models import tiny_llama

VOCAB = 64
PROMPT = [(7 * i) % 50 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama("target", VOCAB, eos_token_id=0, seed=3)


def fresh_logits(target, tokens: list[int], num_logits: int) -> torch.Tensor:
    return ModelRunner(target, max_cached_tokens=1000, prefix_caching=False).extend("x", tokens, num_logits).logits


def test_a_finished_sequences_prefix_is_taken_not_computed(target):
    runner = ModelRunner(target, max_cached_tokens=1000, max_seq_len=64)
    runner.extend("a", PROMPT + [9, 9, 9], 1)
    runner.retire("a")
    asked = PROMPT + [4, 5, 6]                  # the same prompt, another continuation
    second = runner.extend("b", asked, 3)
    assert second.positions_fed == 3            # only what differs from "a"'s tokens
    assert runner.caches.shared_positions == len(PROMPT)
    assert torch.allclose(second.logits, fresh_logits(target, asked, 3), atol=1e-5)
    assert "a" not in runner.caches and runner.caches.retired == 0    # its slot is "b"'s now


def test_a_running_sequences_prefix_is_copied_and_the_donor_goes_on(target):
    runner = ModelRunner(target, max_cached_tokens=1000, max_seq_len=64)
    runner.extend("a", PROMPT, 1)
    [b, a] = runner.extend_batch([ExtendCall("b", PROMPT[:30] + [1, 2], 2),      # shares 30 positions
                                  ExtendCall("a", PROMPT + [11, 12], 2)])         # and "a" extends
    assert (b.positions_fed, a.positions_fed) == (2, 2)
    assert torch.allclose(b.logits, fresh_logits(target, PROMPT[:30] + [1, 2], 2), atol=1e-5)
    assert torch.allclose(a.logits, fresh_logits(target, PROMPT + [11, 12], 2), atol=1e-5)
    later = runner.extend("a", PROMPT + [11, 12, 13], 1)                          # the donor's own slot intact
    assert torch.allclose(later.logits, fresh_logits(target, PROMPT + [11, 12, 13], 1), atol=1e-5)


def test_the_positions_whose_logits_are_wanted_are_computed_even_when_all_are_cached(target):
    runner = ModelRunner(target, max_cached_tokens=1000, max_seq_len=64)
    runner.extend("a", PROMPT, 1)
    runner.retire("a")
    again = runner.extend("b", PROMPT, 4)
    assert again.positions_fed == 4
    assert torch.allclose(again.logits, fresh_logits(target, PROMPT, 4), atol=1e-5)


def test_short_common_starts_and_prefix_caching_off_share_nothing(target):
    runner = ModelRunner(target, max_cached_tokens=1000, max_seq_len=64)
    runner.extend("a", PROMPT, 1)
    runner.retire("a")
    short = PROMPT[:MIN_SHARED_PREFIX - 1] + [1] * 10
    assert runner.extend("b", short, 1).positions_fed == len(short)
    off = ModelRunner(target, max_cached_tokens=1000, max_seq_len=64, prefix_caching=False)
    off.extend("a", PROMPT, 1)
    off.retire("a")
    assert off.extend("b", PROMPT + [1], 1).positions_fed == len(PROMPT) + 1
    assert (off.caches.shared_positions, len(off.caches)) == (0, 1)


def test_retired_caches_are_evicted_before_running_ones():
    store = KVCacheStore(max_tokens=30, max_seq_len=10)            # 3 slots
    for seq_id in ("live-1", "done", "live-2"):
        slots, _ = store.place([seq_id], {})
        store.commit(seq_id, [1] * 8, slots[seq_id])
    store.retire("done")
    store.get("live-1")
    slots, _ = store.place(["new"], {})                            # no free slot: one must go
    store.commit("new", [2] * 8, slots["new"])
    assert "live-1" in store and "live-2" in store and "new" in store and store.retired == 0


def test_the_storage_grows_no_further_than_the_slot_budget_as_finished_caches_fill_it(target):
    runner = ModelRunner(target, max_cached_tokens=6 * 64, max_seq_len=64)      # 6 slots
    for i in range(12):                       # each its own prompt: every finished cache is kept
        runner.extend(f"s{i}", [i + 1] * 20, 1)
        runner.retire(f"s{i}")
    assert runner.caches.capacity == runner.storage.capacity == 6
