"""Turning logits into the distribution a request samples from, and sampling from it.

The target distribution p and the draft distribution q are both *warped* distributions:
logits / temperature, then top-k, then top-p (the order Hugging Face applies them).
Speculative sampling is exact with respect to the warped target distribution.

Numerical safety: a temperature below SAMPLING_EPS is greedy (as vLLM treats it; 1e-300
divides float32 logits into inf and NaN), the nucleus always keeps the most likely token
(a top_p that rounds to 0 in float32 would otherwise keep none), and a distribution that is
not finite, or has no mass, never reaches `multinomial`: it raises NonFiniteDistribution,
which fails that one sequence and no other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Temperatures below this are greedy: logits / 1e-5 still fit float32 comfortably.
SAMPLING_EPS = 1e-5


class NonFiniteDistribution(ValueError):
    """A distribution to sample from holds NaN or inf, or no mass at all."""

    def __init__(self, message: str = "the distribution to sample from is not finite or has no mass"):
        super().__init__(message)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) means greedy (argmax)
    top_p: float = 1.0        # nucleus mass kept, in (0, 1]
    top_k: int = 0            # tokens kept; 0 keeps all
    # Adjustments of the logits before temperature, per position, from the tokens before it
    # (replicas/logits_processing.py, vLLM's definitions):
    presence_penalty: float = 0.0     # minus this for every token the output holds
    frequency_penalty: float = 0.0    # minus this times the token's count in the output
    repetition_penalty: float = 1.0   # a token of the prompt or output: logit / r if > 0, else * r
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    min_tokens: int = 0               # until the output holds this many, `stop_ids` are masked
    stop_ids: tuple[int, ...] = ()    # EOS and the request's stop token ids
    grammar: str | None = None        # llguidance grammar the output must follow (replicas/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before they are warped."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.stop_ids) or self.grammar)


GREEDY = SamplingParams(temperature=0.0)


def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] (float32) of the sampled, non-greedy distribution."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


_NUCLEUS_TOP = 64      # the most likely tokens looked at before sorting a whole row


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, and every token
    as likely as the least likely of them; renormalise. The set: in descending order, each
    token whose mass before it is below top_p (the most likely always). Taking every token
    tied with its last one makes the set a function of the probabilities alone, not of the
    order a sort gives tied ones, so a row's nucleus is the same warped alone or among other
    rows. Found among the _NUCLEUS_TOP most likely tokens where it lies there (a top-k of
    them cost 16 us over 8 rows of 512 here, a full sort 115 us, 2026-12-07); else a sort."""
    width = min(probs.shape[-1], _NUCLEUS_TOP)
    top = torch.topk(probs, width, dim=-1).values                       # [..., width], descending
    mass_before = torch.cumsum(top, dim=-1) - top
    if width < probs.shape[-1] and not bool((mass_before[..., -1] >= top_p).all()):
        top = torch.sort(probs, dim=-1, descending=True).values
        mass_before = torch.cumsum(top, dim=-1) - top
    inside = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)  # the set's size in that order
    threshold = top.gather(-1, inside - 1)                              # its least likely token's p
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """probs [V] -> one token id."""
    check_finite(probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """probs [B, V] (each with mass) -> one token id per row [B], on their device: the first
    token whose cumulative probability exceeds u times the row's mass, u uniform from the row's
    own generator (inverse-CDF sampling: one draw a row, the rows' search in one call; a
    multinomial call a row cost about 26 us here). A token of probability 0 is never drawn:
    its cumulative sum equals the one before it."""
    cumulative = torch.cumsum(probs.float(), dim=-1)                                   # [B, V]
    total = cumulative[:, -1:]
    u = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])[:, None]
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))   # below the mass
    return torch.searchsorted(cumulative, point, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def sampleable(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., V] -> [...] bool: the distribution is finite, non-negative and has mass."""
    return torch.isfinite(probs).all(-1) & (probs >= 0).all(-1) & (probs.sum(-1) > 0)


def check_finite(probs: torch.Tensor) -> None:
    """Raise NonFiniteDistribution unless probs [V] is finite, non-negative and has mass."""
    if not bool(sampleable(probs)):
        raise NonFiniteDistribution()


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on the device whose tensors it samples (CPU and CUDA streams differ for
    one seed; each is as random as the other)."""
    return torch.Generator(device=device).manual_seed(seed % (2**63))
