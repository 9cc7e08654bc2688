"""One batched forward pass over ragged sequences gives each sequence the logits it would get
alone: left padding of the caches is masked, right padding is discarded, positions are per row."""

from __future__ import annotations

import random

import torch

from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from training.tiny_models import tiny_llama


def test_batched_extend_matches_each_sequence_computed_alone():
    model = tiny_llama("target", 64, eos_token_id=0, seed=3)
    rng = random.Random(0)
    sequences = {f"s{i}": [rng.randrange(1, 64) for _ in range(rng.randrange(5, 40))] for i in range(6)}
    batched = ModelRunner(model, max_cached_tokens=10_000)
    for round_index in range(4):
        calls = []
        for seq_id, tokens in sequences.items():
            tokens.extend(rng.randrange(1, 64) for _ in range(rng.randrange(1, 6)))
            calls.append(ExtendCall(seq_id, list(tokens), num_logits=rng.randrange(1, 4)))
        if round_index == 2:
            batched.release("s1")  # one row rebuilt from scratch among cached ones
        results = batched.extend_batch(calls)
        assert max(r.batch_rows for r in results) > 1
        for call, result in zip(calls, results, strict=True):
            alone = ModelRunner(model, max_cached_tokens=10_000).extend("x", call.tokens, call.num_logits)
            assert result.logits.shape == alone.logits.shape
            torch.testing.assert_close(result.logits, alone.logits, atol=1e-4, rtol=1e-4)
