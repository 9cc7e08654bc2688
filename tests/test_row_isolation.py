"""A failure in one sequence's row of a batch fails that sequence alone: the other rows of the
same forward pass get exactly what they would get alone, from a fresh engine. And sampling
is numerically safe: values that made `multinomial` raise for a whole batch are handled."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.protocol import ProposeRequest, RowError, VerifyRequest
from replicas.sampling import (GREEDY, SAMPLING_EPS, NonFiniteDistribution, SamplingParams, make_generator,
                               sample, warped_probs)
from training.tiny_models import tiny_llama

VOCAB = 64
POISON = 7      # the token whose embedding is NaN in the poisoned model
CLEAN = [list(range(10, 22)), list(range(30, 38)), [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def poisoned():
    """A model that computes NaN for any sequence holding token POISON and normal logits for
    every other sequence (attention never mixes rows)."""
    model = tiny_llama("target", VOCAB, eos_token_id=0, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    return model


def fresh_verify(model, request: VerifyRequest):
    [alone] = TargetEngine.on_model(model, max_cached_tokens=1000).verify([request])
    return alone


def test_a_row_with_nan_logits_fails_alone_and_its_batch_is_exact(poisoned):
    requests = [VerifyRequest("a", CLEAN[0], [11, 12, 13], None, GREEDY, 0),
                VerifyRequest("poison", [5, 6, POISON, 8], [1, 2], None, GREEDY, 0),
                VerifyRequest("b", CLEAN[1], [], None, SAMPLED, 5),
                VerifyRequest("c", CLEAN[2], [3, 4], None, SAMPLED, 9)]
    engine = TargetEngine.on_model(poisoned, max_cached_tokens=1000)
    results = engine.verify(requests)
    failed = results[1]
    assert isinstance(failed, RowError) and failed.seq_id == "poison"
    assert failed.kind == "NonFiniteDistribution"
    assert "poison" not in engine.runner.caches    # its cache holds the same NaN: dropped
    for request, result in zip(requests, results):
        if request.seq_id != "poison":
            alone = fresh_verify(poisoned, request)
            assert (result.tokens, result.accepted) == (alone.tokens, alone.accepted)


def test_a_draft_row_that_cannot_sample_fails_alone(poisoned):
    requests = [ProposeRequest("a", CLEAN[0], 3, SAMPLED, 1),
                ProposeRequest("poison", [POISON, 9], 3, SAMPLED, 2),
                ProposeRequest("b", CLEAN[1], 2, GREEDY, 3)]
    results = DraftEngine.on_model(poisoned, max_cached_tokens=1000).propose(requests)
    assert isinstance(results[1], RowError) and results[1].kind == "NonFiniteDistribution"
    for request, result in zip(requests, results):
        if request.seq_id != "poison":
            [alone] = DraftEngine.on_model(poisoned, max_cached_tokens=1000).propose([request])
            assert result.tokens == alone.tokens and len(result.tokens) == request.k
            assert (result.probs is None) == (alone.probs is None)
            if result.probs is not None:
                assert torch.allclose(result.probs.dense(), alone.probs.dense(), atol=1e-6)


def test_a_malformed_row_fails_alone():
    model = tiny_llama("target", VOCAB, eos_token_id=0, seed=3)
    narrow_q = torch.full((2, 4), 0.25)          # q over 4 tokens, not VOCAB
    requests = [VerifyRequest("bad", CLEAN[0], [11, 12], narrow_q, SAMPLED, 0),
                VerifyRequest("good", CLEAN[1], [31, 32], None, GREEDY, 0)]
    bad, good = TargetEngine.on_model(model, max_cached_tokens=1000).verify(requests)
    assert isinstance(bad, RowError) and bad.kind == "ValueError" and bad.seq_id == "bad"
    assert "draft_probs of shape (2, 4) for 2 drafts over 64 tokens" in bad.message
    alone = fresh_verify(model, requests[1])
    assert (good.tokens, good.accepted) == (alone.tokens, alone.accepted)


def test_row_errors_cross_processes_intact():
    error = pickle.loads(pickle.dumps(RowError("s1", "NonFiniteDistribution", "NaN")))
    assert (error.seq_id, error.kind, error.message) == ("s1", "NonFiniteDistribution", "NaN")


@pytest.mark.parametrize("temperature", [0.0, 1e-300, 5e-324, 1e-45, SAMPLING_EPS / 2])
def test_a_temperature_below_epsilon_is_greedy(temperature):
    assert SamplingParams(temperature).greedy
    assert not SamplingParams(SAMPLING_EPS).greedy


def test_the_smallest_temperature_sampled_stays_finite():
    logits = torch.randn(3, VOCAB) * 30
    probs = warped_probs(logits, SamplingParams(SAMPLING_EPS))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-40])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.randn(2, VOCAB)
    probs = warped_probs(logits, SamplingParams(1.0, top_p=top_p))
    assert torch.isfinite(probs).all()
    expected = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("probs", [
    torch.tensor([0.5, math.nan, 0.5]), torch.tensor([0.0, 0.0, 0.0]), torch.tensor([math.inf, 0.0, 1.0]),
    torch.tensor([-0.5, 1.0, 0.5]),
], ids=["nan", "no-mass", "inf", "negative"])
def test_a_distribution_that_is_not_finite_never_reaches_multinomial(probs):
    with pytest.raises(NonFiniteDistribution):
        sample(probs, make_generator(0))
