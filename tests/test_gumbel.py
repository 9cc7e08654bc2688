"""Seeded sampling by Gumbel-max with public noise (replicas/gumbel.py): the noise is a fixed
function of (seed, position, token); a choice is a sample from p; speculative output with it
is the target's own choice at every position, whatever k, draft or batch; and its samples
have exactly the target's distribution."""

from __future__ import annotations

import pytest
import torch

from cluster.bench.chi_square import chi_square_p_value
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.gumbel import exponential_noise, gumbel_choices, hash32
from replicas.protocol import ProposeRequest, VerifyRequest
from replicas.sampling import SamplingParams
from router.speculation import round_seed
from tests.test_logits_processing import reference_probs
from tests.test_sampling_exactness import (ALPHA, PROMPT, exact_joint, pair,  # noqa: F401
                                          speculative_pairs)

WARPED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


def _fmix32(x: int) -> int:
    """murmur3's finaliser, in Python's unbounded integers: the reference."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_hash(seed: int, position: int, token: int) -> int:
    key = _fmix32((seed & 0xFFFFFFFF) ^ _fmix32(((seed >> 32) + 0x9E3779B9) & 0xFFFFFFFF))
    return _fmix32(_fmix32(key ^ position) ^ _fmix32(token + 0x632BE5AB))


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40 + 7, 2**63 - 1])
def test_the_noise_hash_is_exact_integer_arithmetic(seed):
    positions = torch.tensor([0, 1, 511, 2**31 - 1])
    got = hash32(seed, positions, 64)
    for i, position in enumerate(positions.tolist()):
        assert got[i].tolist() == [_reference_hash(seed, position, t) for t in range(64)]


def test_the_noise_of_a_position_does_not_depend_on_what_else_is_computed():
    alone = exponential_noise(7, torch.tensor([12]), 100)
    among = exponential_noise(7, torch.arange(10, 15), 100)
    assert torch.equal(alone[0], among[2])
    assert not torch.equal(among[0], among[1])
    assert not torch.equal(alone, exponential_noise(8, torch.tensor([12]), 100))
    assert (alone > 0).all() and torch.isfinite(alone).all()


def test_a_gumbel_choice_is_a_sample_from_p_and_never_outside_its_support():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0])
    draws = 20000
    counts = torch.zeros(6)
    for seed in range(draws // 500):
        # 500 positions of one seed: independent draws, as the positions of one sequence are
        choices = gumbel_choices(p.expand(500, 6), seed, 0)
        counts += torch.bincount(choices, minlength=6).float()
    assert counts[4:].sum() == 0
    assert chi_square_p_value(counts, p) > ALPHA


def seeded_generation(target, draft, k_of_round, seed: int, length: int, others: int = 0) -> list[int]:
    """A seeded sequence generated speculatively through the engines: round r drafts
    k_of_round(r) tokens (0: the target alone); `others` unseeded sequences share its batches."""
    drafts, verifier = DraftEngine.on_model(draft, 1000), TargetEngine.on_model(target, 1000)
    rows = {"seeded": list(PROMPT)} | {f"other{i}": [1 + i] for i in range(others)}
    for r in range(length):
        if len(rows["seeded"]) >= len(PROMPT) + length:
            break
        k = k_of_round(r)
        names = list(rows)
        proposals = drafts.propose([ProposeRequest(n, rows[n], k, WARPED, round_seed(r, 0, n),
                                                   noise_seed=seed if n == "seeded" else None)
                                    for n in names]) if k else [None] * len(names)
        verdicts = verifier.verify([VerifyRequest(n, rows[n], p.tokens if p else [], p.probs if p else None,
                                                  WARPED, round_seed(r, 1, n), noise_seed=seed if n == "seeded" else None)
                                    for n, p in zip(names, proposals)])
        for n, verdict in zip(names, verdicts):
            rows[n] += verdict.tokens
    return rows["seeded"][len(PROMPT):len(PROMPT) + length]


def test_a_seeded_sequence_is_the_same_whatever_k_draft_and_batch(pair):
    target, draft = pair
    alone = seeded_generation(target, draft, lambda r: 0, seed=42, length=12)
    assert len(set(alone)) > 2
    for k_of_round in (lambda r: 1, lambda r: 3, lambda r: 5, lambda r: (r * 7) % 6):
        assert seeded_generation(target, draft, k_of_round, seed=42, length=12) == alone
        assert seeded_generation(target, target, k_of_round, seed=42, length=12) == alone     # another draft
        assert seeded_generation(target, draft, k_of_round, seed=42, length=12, others=5) == alone
    assert seeded_generation(target, draft, lambda r: 3, seed=43, length=12) != alone


def seeded_pairs(target, draft, samples: int, k_of_round) -> torch.Tensor:
    """Counts [V, V] of the first two tokens of seeded speculative generations, one seed each."""
    return speculative_pairs(target, draft, WARPED, seed=5, samples=samples, k_of=lambda r, i: k_of_round(r),
                             seeded=True)


def test_seeded_speculative_samples_have_the_target_distribution(pair):
    target, draft = pair
    counts = seeded_pairs(target, draft, 2000, lambda r: 1 + r % 3)
    assert chi_square_p_value(counts, exact_joint(target, WARPED)) > ALPHA


def test_the_distribution_test_catches_noise_shared_across_seeds(pair, monkeypatch):
    """Noise that ignores the seed gives every sequence the same tokens: far from p."""
    import replicas.gumbel as gumbel

    target, draft = pair
    real = gumbel.exponential_noise
    monkeypatch.setattr(gumbel, "exponential_noise", lambda seed, positions, vocab: real(0, positions, vocab))
    counts = seeded_pairs(target, draft, 400, lambda r: 2)
    assert chi_square_p_value(counts, exact_joint(target, WARPED)) < ALPHA


def test_the_gumbel_rule_keeps_drafts_between_its_bounds(pair):
    """P(the draft's choice equals the target's) lies in [(1 - TV) / (1 + TV), 1 - TV]
    (Daliri, Musco and Suresh 2024): measured on the pair's first position."""
    target, draft = pair
    with torch.inference_mode():
        p = reference_probs(target(torch.tensor([PROMPT])).logits[0, -1], WARPED, PROMPT, len(PROMPT))[None]
        q = reference_probs(draft(torch.tensor([PROMPT])).logits[0, -1], WARPED, PROMPT, len(PROMPT))[None]
    tv = 0.5 * float((p - q).abs().sum())
    agree = sum(int(gumbel_choices(p, s, 0)[0] == gumbel_choices(q, s, 0)[0]) for s in range(4000)) / 4000
    assert (1 - tv) / (1 + tv) - 0.03 <= agree <= 1 - tv + 0.03
