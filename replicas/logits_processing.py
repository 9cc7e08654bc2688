"""A request's adjustments of the target's (and the draft's) logits, per position of a window,
before temperature, top-k and top-p (replicas/sampling.py): logit bias, the min_tokens mask,
then the repetition, frequency and presence penalties, in vLLM's order and with its meaning.

Terms (one sequence, rows computed by one forward pass):
- history: the sequence's tokens up to the last position the pass computed: the prompt, the
  output so far, then the window's drafts d_1..d_k (for a verify; none for a draft step).
- row j of the logits (0 <= j <= k): the distribution of the token after history minus its
  last k - j tokens, so its context holds d_1..d_j. The penalties of row j count the output
  tokens of that context, the window's earlier drafts included: the target alone would have
  generated those tokens one step at a time and counted them, and speculation must give what
  the target alone gives.
- output: the tokens after the prompt (`prompt_len` of them).

Per row j, for a token t:
- logit_bias: l_t + b_t.
- min_tokens: l_t = -inf for t in stop_ids (EOS, stop token ids) while the row's output is
  shorter than min_tokens.
- repetition_penalty r: where t is in the row's prompt or output, l_t / r if l_t > 0 else l_t * r.
- frequency_penalty f, presence_penalty a: l_t - f * c_t - a * [c_t > 0], c_t the count of t
  in the row's output.
- grammar: l_t = -inf for t the grammar does not allow after the row's output
  (replicas/grammar.py), last, so that no bias or penalty brings a forbidden token back.
"""

from __future__ import annotations

import torch

from replicas.grammar import GrammarMasks
from replicas.sampling import SamplingParams


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, history: list[int],
                    prompt_len: int, grammars: GrammarMasks | None = None) -> torch.Tensor:
    """logits [n, V] of the last n positions of `history` -> the adjusted logits [n, V]
    (float32; the input itself when the request adjusts nothing). `grammars`: the engine's
    masks, for a request with a grammar."""
    if not params.adjusts:
        return logits
    n, vocab = logits.shape
    device = logits.device
    out = logits.float().clone()
    first = len(history) - n + 1                 # row 0's context: history[:first]
    window = history[first:]                     # d_1..d_(n-1): row j's context ends with d_1..d_j
    bias = [(t, b) for t, b in params.logit_bias if t < vocab]   # a draft's vocabulary may be smaller
    if bias:
        ids, values = zip(*bias)
        out[:, torch.tensor(ids, device=device)] += torch.tensor(values, device=device)
    if params.min_tokens and params.stop_ids:
        output_len = torch.arange(n, device=device) + (first - prompt_len)       # [n]
        held = output_len < params.min_tokens
        if bool(held.any()):
            stops = torch.tensor(params.stop_ids, device=device)
            out[held[:, None] & torch.isin(torch.arange(vocab, device=device), stops)[None]] = float("-inf")
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        counts = _counts(history[prompt_len:first], window, n, vocab, device)    # [n, V] output counts
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | (_bincount(history[:prompt_len], vocab, device) > 0)[None]
            penalised = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(seen, penalised, out)
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.grammar is not None:
        if grammars is None:
            raise ValueError("this engine applies no grammar")
        allowed = grammars.rows(params.grammar, history[prompt_len:first], window, vocab, device)
        out = out.masked_fill(~allowed, float("-inf"))
    return out


def _bincount(tokens: list[int], vocab: int, device) -> torch.Tensor:
    """Counts [V] of the tokens (ids past the vocabulary, of a smaller draft's, left out)."""
    if not tokens:
        return torch.zeros(vocab, device=device)
    return torch.bincount(torch.tensor(tokens, device=device), minlength=vocab)[:vocab].float()


def _counts(before: list[int], window: list[int], n: int, vocab: int, device) -> torch.Tensor:
    """[n, V]: row j counts `before` plus window[:j]."""
    counts = _bincount(before, vocab, device)[None].repeat(n, 1)
    if window:
        steps = torch.zeros(len(window), vocab, device=device)
        ids = torch.tensor(window, device=device)
        steps[torch.arange(len(window), device=device), ids.clamp(max=vocab - 1)] = (ids < vocab).float()
        counts[1:] += steps.cumsum(0)
    return counts
