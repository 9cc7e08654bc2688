"""Chunked prefill (ModelRunner's prefill_chunk): a prompt longer than the chunk is computed a
chunk of positions a pass, each pass extending the cache the next reuses, beside other rows;
its logits are the whole prefill's within float32 rounding, and greedy decoding after it
gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner

TARGET = Path("models/target").resolve()
CHUNK = 64


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(ModelSpec(path=TARGET, dtype="float32"), device=torch.device("cpu"))


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1, 512, (length,), generator=generator).tolist() for length in (300, 40, 129)]


def greedy(runner: ModelRunner, seq_id: str, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(runner.extend(seq_id, tokens, 1).logits[-1].argmax()))
    return tokens[len(prompt):]


def test_a_long_prefill_in_chunks_gives_the_whole_prefills_logits_and_tokens(model):
    whole = ModelRunner(model, 32768, 512)
    chunked = ModelRunner(model, 32768, 512, prefill_chunk=CHUNK)
    calls = [ExtendCall(f"s{i}", prompt, 3) for i, prompt in enumerate(prompts())]
    expected, got = whole.extend_batch(calls), chunked.extend_batch(calls)
    assert whole.widest_pass == 300 and chunked.widest_pass == CHUNK
    for want, have in zip(expected, got):
        assert torch.allclose(want.logits, have.logits, atol=1e-4, rtol=1e-4)
    for i, prompt in enumerate(prompts()):
        assert greedy(chunked, f"g{i}", prompt, 8) == greedy(whole, f"g{i}", prompt, 8)


def test_a_cache_too_small_for_the_chunks_still_answers(model):
    """Evicted between chunks (a budget below the prompt), the call runs whole: no loop."""
    tiny = ModelRunner(model, 100, 128, prefill_chunk=16)
    out = tiny.extend("s", prompts()[2][:120], 2)
    assert out.logits.shape[0] == 2


def test_the_pools_setting_reaches_its_runner():
    from cluster.config import ClusterConfig
    from replicas.engines import huggingface

    config = ClusterConfig.model_validate({"models": {"target": {"path": str(TARGET), "dtype": "float32"}},
                                           "pools": {"target": {"prefill_chunk_tokens": CHUNK}}})
    engine = huggingface.build("target", config.models.target, config.pools.target, 512)
    assert engine.runner.prefill_chunk == CHUNK
