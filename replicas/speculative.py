"""The speculative sampling rule: which draft tokens the target keeps.

Terms (one round, k draft tokens d_1..d_k):
- p_i: the target's warped distribution for position i, given the sequence and d_1..d_{i-1};
  p has k + 1 rows, the last one following d_k.
- q_i: the draft's warped distribution that d_i was sampled from (one-hot when the draft
  proposed greedily, and for drafts copied by prompt lookup, replicas/drafting/lookup.py: a function of
  the context, fixed before the target's randomness, so the rule below stays exact).
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

from replicas.sampling import NonFiniteDistribution, SamplingParams, sample_rows, sampleable, warped_probs


@dataclass(frozen=True)
class RoundOutcome:
    accepted: int          # n: leading drafts kept
    tokens: list[int]      # the n accepted drafts, then the recovered or bonus token


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for a drafted token x; q(x) > 0 since x was sampled from q."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for p, q [..., V]. Mass exists whenever a rejection happened (p(x) <
    q(x) for some x forces p(y) > q(y) elsewhere); a float underflow falls back to p."""
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)


def greedy_round(choices: list[int], drafts: list[int]) -> RoundOutcome:
    """choices: the target's argmax at each of the k + 1 positions; drafts: k ids. Keep
    drafts while they match the argmax."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return RoundOutcome(accepted, drafts[:accepted] + [choices[accepted]])


def sampled_outcomes(decisions: list[list[int]], drafts: list[list[int]]) -> list[RoundOutcome | NonFiniteDistribution]:
    """sampled_decisions' [3, B] values, read, as each row's outcome."""
    counts, tokens, failed = decisions
    return [NonFiniteDistribution() if failed[b] else RoundOutcome(counts[b], drafts[b][:counts[b]] + [tokens[b]])
            for b in range(len(drafts))]


def sampled_decisions(
    target_logits: list[torch.Tensor],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> torch.Tensor:
    """The rule for B sequences at once, on the logits' device. Row b: target_logits[b]
    [k_b + 1, V], drafts[b] k_b ids, draft_probs[b] q [k_b, V] or None when the draft proposed
    greedily (q one-hot at each draft), generators[b] on the logits' device. Rows are padded
    to K = max k_b. Returns [3, B] on the device: each row's accepted count n, the token
    after them, and 1 where the distribution to sample from was not finite (its row then
    gets NonFiniteDistribution); nothing is read to the host here."""
    rows, K = len(drafts), max(len(d) for d in drafts)
    device = target_logits[0].device
    lengths = torch.tensor([len(d) for d in drafts], device=device)                     # [B]
    p = _warped(target_logits, params, K + 1)                                          # [B, K + 1, V]
    q = _draft_q(draft_probs, drafts, K, p.shape[-1], device)                          # [B, K, V]
    ids = torch.tensor([d + [0] * (K - len(d)) for d in drafts], device=device)        # [B, K]
    real = torch.arange(K, device=device)[None] < lengths[:, None]                     # [B, K]
    # Each row draws its own k_b uniforms, so its outcome does not depend on its batch.
    u = torch.ones(rows, K, device=device)                                             # [B, K]
    for b, (d, g) in enumerate(zip(drafts, generators)):
        if d:
            u[b, :len(d)] = torch.rand(len(d), generator=g, device=device)
    p_x = p[:, :K].gather(-1, ids[..., None])[..., 0]                                  # [B, K]
    q_x = torch.where(real, q.gather(-1, ids[..., None])[..., 0], 1.0)                 # [B, K]
    kept = (u < acceptance_probability(p_x, q_x)) & real                               # [B, K]
    accepted = kept.long().cumprod(-1).sum(-1)                                         # [B]: n
    rejected = accepted < lengths
    row = torch.arange(rows, device=device)
    p_next = p[row, accepted]                                                          # [B, V]
    q_next = q[row, accepted.clamp(max=K - 1)] if K else torch.zeros_like(p_next)
    follow = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)   # [B, V]
    broken = ~sampleable(follow)                                                       # [B]
    follow = torch.where(broken[:, None], torch.ones_like(follow), follow)
    token = sample_rows(follow, generators)                                           # [B]
    return torch.stack([accepted, token, broken.long()])


def _warped(target_logits: list[torch.Tensor], params: list[SamplingParams], length: int) -> torch.Tensor:
    """Each row's warped p [k_b + 1, V] in a [B, length, V] tensor (the rows past k_b + 1 are
    warped zero logits, never read). Rows that warp alike (temperature, top-k, top-p) are
    warped in one call: a position's probabilities depend on its own logits alone, and a call
    per row cost about 90 us a row here (2026-12-07), most of a sampled step's rule."""
    logits = torch.stack([_padded(rows.float(), length) for rows in target_logits])   # [B, length, V]
    rows, vocab = logits.shape[0], logits.shape[-1]
    groups: dict[tuple, list[int]] = {}
    for b, each in enumerate(params):
        groups.setdefault((each.temperature, each.top_k, each.top_p), []).append(b)
    if len(groups) == 1:
        return warped_probs(logits.reshape(-1, vocab), params[0]).reshape(rows, length, vocab)
    p = torch.empty_like(logits)
    for members in groups.values():
        index = torch.tensor(members, device=logits.device)
        p[index] = warped_probs(logits[index].reshape(-1, vocab), params[members[0]]).reshape(len(members), length, vocab)
    return p


def _draft_q(draft_probs: list[torch.Tensor | None], drafts: list[list[int]], length: int, vocab: int,
             device: torch.device) -> torch.Tensor:
    """Each row's q [k_b, V] in a [B, length, V] tensor of zeros: the draft's where it sent one,
    else one-hot at each draft (a greedy or lookup draft)."""
    q = torch.zeros(len(drafts), length, vocab, device=device)
    rows, positions, tokens = [], [], []
    for b, (probs, row_drafts) in enumerate(zip(draft_probs, drafts)):
        if probs is not None:
            q[b, :len(row_drafts)] = probs.to(device)
        else:
            rows += [b] * len(row_drafts)
            positions += range(len(row_drafts))
            tokens += row_drafts
    if tokens:
        q[torch.tensor(rows), torch.tensor(positions), torch.tensor(tokens)] = 1.0
    return q


def _padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    """[n, V] -> [length, V], zero rows appended."""
    return torch.cat([rows, rows.new_zeros(length - rows.shape[0], rows.shape[1])]) if rows.shape[0] < length else rows
