"""A KV cache sized from the device's free memory (replicas/engines/huggingface/kv_sizing.py):
`kv_cache.max_tokens: auto` gives a GPU replica memory_fraction of what is free after its
weights over what a position costs, computed here on the bundled target's real layers with the
free memory stated (this machine has no GPU); a number is kept as it is, and a CPU gets its
fixed default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.kv_sizing import DEFAULT_CPU_TOKENS, kv_cache_tokens, position_bytes
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from replicas.engines.huggingface.shard_loading import load_shard

TARGET = Path("models/target").resolve()


@pytest.fixture(scope="module")
def target():
    return load_causal_lm(ModelSpec(path=TARGET, dtype="bfloat16"), device=torch.device("cpu"))


def test_a_position_costs_a_key_and_a_value_per_layer_and_head_in_the_dtype(target):
    config = target.config
    kv_width = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    assert position_bytes(target) == 2 * config.num_hidden_layers * kv_width * 2        # bfloat16: 2 bytes
    # a shard of two holds half the key/value heads, so a position costs it half
    shard = load_shard(ModelSpec(path=TARGET, dtype="bfloat16"), 1, 2, torch.device("cpu"))
    assert position_bytes(shard) * 2 == position_bytes(target)


def test_auto_takes_the_fraction_of_free_gpu_memory_and_a_number_is_kept(target):
    free = 10 * 2**30
    tokens = kv_cache_tokens("auto", target, torch.device("cuda"), 0.8, free_bytes=free)
    assert tokens == int(free * 0.8) // position_bytes(target)
    assert kv_cache_tokens(4096, target, torch.device("cuda"), 0.8, free_bytes=free) == 4096
    assert kv_cache_tokens("auto", target, torch.device("cpu"), 0.8) == DEFAULT_CPU_TOKENS
    with pytest.raises(RuntimeError, match="no room for a KV cache"):
        kv_cache_tokens("auto", target, torch.device("cuda"), 0.8, free_bytes=100)


def test_a_runner_holds_the_positions_auto_gave_it(target):
    """What the budget means in the cache: 2 MiB free at 0.5 over the bundled target's
    positions, slots of 256 positions; sequences beyond it are evicted, none fails."""
    tokens = kv_cache_tokens("auto", target, torch.device("cuda"), 0.5, free_bytes=2 * 2**20)
    runner = ModelRunner(target, tokens, 256)
    for i in range(runner.caches.max_slots + 2):
        runner.extend_batch([ExtendCall(f"s{i}", list(range(1, 200)), 1)])
    assert runner.caches.max_tokens == tokens and runner.caches.evictions >= 2
    assert runner.caches.cached_tokens <= tokens
