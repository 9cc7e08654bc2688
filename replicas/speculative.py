"""The speculative sampling rule: which draft tokens the target keeps.

Terms (one round, k draft tokens d_1..d_k):
- p_i: the target's warped distribution for position i, given the sequence and d_1..d_{i-1};
  p has k + 1 rows, the last one following d_k.
- q_i: the draft's warped distribution that d_i was sampled from (one-hot when the draft
  proposed greedily).
- accepted tokens: the leading drafts the rule keeps, n of them (0 <= n <= k).
- recovered token: after the first rejection (at position n + 1), a token sampled from the
  residual norm(max(0, p_{n+1} - q_{n+1})).
- bonus token: when all k drafts are accepted, a token sampled from p_{k+1}.
Every round therefore yields n accepted tokens plus exactly one recovered or bonus token.

Rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)). The output then has exactly the distribution p.
For greedy requests p is one-hot at the target's argmax, so the rule reduces to "keep drafts
while they equal the target's argmax", and the output equals target-only greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.sampling import SamplingParams, sample, warped_probs


@dataclass(frozen=True)
class RoundOutcome:
    accepted: int          # n: leading drafts kept
    tokens: list[int]      # the n accepted drafts, then the recovered or bonus token


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for a drafted token x; q(x) > 0 since x was sampled from q."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for p, q [V]. Mass exists whenever a rejection happened (p(x) < q(x)
    for some x forces p(y) > q(y) elsewhere); a float underflow falls back to p."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def greedy_round(target_logits: torch.Tensor, drafts: list[int]) -> RoundOutcome:
    """target_logits [k+1, V]; drafts: k ids. Keep drafts while they match the argmax."""
    choices = target_logits.argmax(dim=-1).tolist()  # [k+1]
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return RoundOutcome(accepted, drafts[:accepted] + [choices[accepted]])


def sampled_round(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> RoundOutcome:
    """target_logits [k+1, V]; drafts: k ids; draft_probs q [k, V], or None when the draft
    proposed greedily (q one-hot at each draft)."""
    p = warped_probs(target_logits, params)  # [k+1, V]
    q = draft_probs if draft_probs is not None else _one_hot(drafts, p.shape[-1])  # [k, V]
    for i, token in enumerate(drafts):
        u = torch.rand((), generator=generator)
        if u < acceptance_probability(p[i, token], q[i, token]):
            continue
        recovered = sample(residual_distribution(p[i], q[i]), generator)
        return RoundOutcome(i, drafts[:i] + [recovered])
    bonus = sample(p[len(drafts)], generator)
    return RoundOutcome(len(drafts), drafts + [bonus])


def _one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    q = torch.zeros(len(tokens), vocab)
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return q
