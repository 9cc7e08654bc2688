"""Overlapped drafting: the next window's drafts, drafted while this window is verified.

Terms (one round, as in replicas/speculative.py): the sequence's tokens x, this window's
drafts d_1..d_k, sent to the target for verification. At the same time the draft pool is
asked for the *lookahead*: k' + 1 tokens after x + d, namely

- g, a guess of the token the target adds after d_k (its bonus token when it keeps all k),
- e_1..e_k', drafts of the window after that, with their distributions q (when sampling).

When the verification keeps all k drafts and its bonus token is g, the next round's context
is exactly x + d + g, so e_1..e_k' are drafts for it, ready: that round skips its draft call
and only verifies (PEARL, Liu et al. 2024; AMUSD, McDanel 2024). Otherwise the lookahead is
discarded; it cost draft-pool time only.

Exactness: the acceptance rule is exact for drafts sampled from any distribution q as long
as each draft was sampled from the q row sent with it, independently of the target's
randomness of the round that verifies it. The e_i were sampled by the draft from
q(. | x + d + g, e_<i) before that round began, with their own seed, and are used only in
the context they were sampled for; greedy output does not depend on drafts at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.protocol import Proposal, Verification


@dataclass(frozen=True)
class Drafts:
    tokens: list[int]                 # drafts for the next window
    probs: torch.Tensor | None        # their q rows, None when greedy
    proposal: Proposal                # the lookahead call's answer


def lookahead_size(k: int, cap_after: int) -> int:
    """Drafts worth looking ahead for: the next window's k, within the tokens the request may
    still produce once this window is kept whole (cap_after), so the lookahead never drafts
    past the request's end (nor past the context length)."""
    return max(0, min(k, cap_after))


def usable_drafts(drafts: list[int], verdict: Verification, lookahead: Proposal, k_next: int) -> Drafts | None:
    """The lookahead's drafts for the next window, or None when its guess did not hold: the
    verification kept fewer than all `drafts`, or added a token other than the guess."""
    if not lookahead.tokens or verdict.accepted < len(drafts) or verdict.tokens[-1] != lookahead.tokens[0]:
        return None
    count = min(k_next, len(lookahead.tokens) - 1)
    probs = lookahead.probs[1:1 + count] if lookahead.probs is not None else None
    return Drafts(lookahead.tokens[1:1 + count], probs, lookahead)
