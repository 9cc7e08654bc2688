"""Pearson's chi-square goodness of fit, for the sampled-exactness checks (the tests, and
cluster/bench/gpu_check.py on a machine without them)."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against the cells' probabilities; cells expecting
    fewer than 5 samples are pooled into one."""
    counts, expected = counts.flatten().double().cpu(), probs.flatten().double().cpu() * counts.sum().cpu()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    # one cell holding all the mass leaves no degree of freedom: the test could tell nothing
    assert len(observed) >= 2, "all the expected mass lies in one cell: the test has no power"
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(observed) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))
