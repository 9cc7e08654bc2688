"""Sampling a batch's rows together (replicas/sampling.py): the nucleus found among the most
likely tokens or by a sort, and one inverse-CDF draw a row from the row's own generator,
against transformers' top-p warper and the distributions they sample from."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from cluster.bench.chi_square import chi_square_p_value
from replicas.sampling import SamplingParams, make_generator, sample_rows, warped_probs

V = 512


def rows_of_all_kinds(seed: int = 0) -> torch.Tensor:
    """Logits [6, V]: peaked rows (their nucleus among the 64 most likely tokens) and flat
    ones (it is not: the sort path)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([6.0, 4.0, 3.0, 0.3, 0.1, 1.0])[:, None]
    return torch.randn(6, V, generator=generator) * scales


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_the_nucleus_is_transformers_top_p_on_peaked_and_flat_rows(top_p):
    logits = rows_of_all_kinds()
    params = SamplingParams(temperature=0.8, top_p=top_p)
    ours = warped_probs(logits, params)
    scores = TopPLogitsWarper(top_p)(None, logits / 0.8)
    reference = torch.softmax(scores, dim=-1)
    assert torch.equal(ours > 0, reference > 0)
    torch.testing.assert_close(ours, reference)
    assert (ours > 0).sum(-1).max() > 64 and (ours > 0).sum(-1).min() < 64    # both paths ran


def test_a_row_warps_the_same_alone_and_among_rows_ties_included():
    logits = rows_of_all_kinds(1)
    logits[2, :4] = logits[2].max() + 1.0      # four tied most likely tokens: a nucleus boundary among them
    params = SamplingParams(temperature=1.0, top_p=0.3)
    together = warped_probs(logits, params)
    for row in range(logits.shape[0]):
        assert torch.equal(warped_probs(logits[row:row + 1], params)[0], together[row])
    assert (together[2, :4] > 0).all()         # all tied tokens kept, whichever order a sort gave them


def test_rows_are_drawn_from_their_distributions_and_never_a_token_of_probability_zero():
    probs = torch.zeros(3, 6)
    probs[0, 1:4] = torch.tensor([0.2, 0.5, 0.3])            # zero first and last
    probs[1, 5] = 1.0
    probs[2] = torch.tensor([0.1, 0.0, 0.4, 0.0, 0.0, 0.5])
    counts = torch.zeros(3, 6)
    generators = [make_generator(seed) for seed in (1, 2, 3)]
    for _ in range(6000):
        counts[torch.arange(3), sample_rows(probs, generators)] += 1
    assert (counts[probs == 0] == 0).all()
    for row in (0, 2):
        assert chi_square_p_value(counts[row], probs[row]) > 1e-3


def test_a_rows_draw_depends_on_its_generator_alone():
    probs = torch.softmax(rows_of_all_kinds(2), dim=-1)
    together = sample_rows(probs, [make_generator(seed) for seed in range(6)])
    alone = [int(sample_rows(probs[row:row + 1], [make_generator(row)])[0]) for row in range(6)]
    assert together.tolist() == alone
