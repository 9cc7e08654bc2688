"""Seeded sampling that does not depend on how tokens fall into rounds: the Gumbel-max trick
with public noise (drafter-invariant speculative decoding, Daliri, Musco and Suresh 2024).

Terms:
- position a: the index in the sequence (prompt included) of the token being chosen.
- E_a: noise [V], one Exp(1) variable per token id, a fixed function of (seed, a) alone.
- choice at a from a distribution p [V]: argmax_x p(x) / E_a(x). Since -log E_a(x) is a
  Gumbel variable, this is argmax_x log p(x) + G_a(x), a sample from p (the Gumbel-max
  trick); tokens outside p's support (top-k, top-p) score 0 and are never chosen.

For a seeded request the target's token at a is its choice from its warped distribution p_a,
the draft proposes its choice from its own q_a with the same E_a, and a draft is kept exactly
when it equals the target's choice. Every output token is then the target's own choice at its
position, given the tokens before it: the output is fixed by the seed, whatever k, overlap,
batch, draft or replica produced it, and is distributed exactly as p. A draft is kept with
probability P(choice under q == choice under p), at least (1 - TV) / (1 + TV) where min(1, p/q)
keeps 1 - TV (TV: total variation between p and q), so unseeded requests keep that rule.

The noise is a counter-based hash of (seed, a, x) in exact integer arithmetic: the same bits
on any device, any batch shape, any replica; nothing is drawn from a generator's stream.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Constants of murmur3's 32-bit finaliser (fmix32), split into 16-bit halves so that every
# product fits int64 exactly: x * c mod 2^32 = x * lo + ((x * hi) mod 2^16) << 16.
_C1 = (0x85EB, 0xCA6B)
_C2 = (0xC2B2, 0xAE35)


def _mul32(x: torch.Tensor, constant: tuple[int, int]) -> torch.Tensor:
    hi, lo = constant
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def hash32(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n] positions (int64) -> [n, vocab] int64 hashes in [0, 2^32) of (seed, position, token)."""
    device = positions.device
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _fmix32(torch.tensor([seed_lo], device=device) ^ _fmix32(torch.tensor([(seed_hi + 0x9E3779B9) & _MASK32], device=device)))
    row = _fmix32(key ^ (positions & _MASK32))                                     # [n]
    tokens = torch.arange(vocab, device=device, dtype=torch.int64)
    return _fmix32(row[:, None] ^ _fmix32(tokens + 0x632BE5AB)[None, :])           # [n, V]


def exponential_noise(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """E [n, V] float64: Exp(1) variables, one per (position, token id), fixed by the seed."""
    u = (hash32(seed, positions, vocab).double() + 0.5) / 2.0**32                   # in (0, 1)
    return -torch.log(u)


def gumbel_choices(probs: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """probs [n, V] of positions first_position .. first_position + n - 1 -> [n] token ids:
    argmax p / E at each."""
    positions = torch.arange(first_position, first_position + probs.shape[0], device=probs.device)
    return (probs.double() / exponential_noise(seed, positions, probs.shape[-1])).argmax(-1)
