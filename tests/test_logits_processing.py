"""A request's logit adjustments per position of a verify window (replicas/logits_processing.py)
against a reference built apart from it: transformers' own processors for the repetition
penalty and the min-new-tokens mask, and the vLLM definitions of logit bias and the frequency
and presence penalties written out token by token, applied to each position's context alone
(the sequence up to that position, the window's earlier drafts included)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

import replicas.logits_processing as processing
from replicas.logits_processing import adjusted_logits
from replicas.sampling import SamplingParams

VOCAB = 40
EOS, STOP = 0, 7


def reference_row(logits: torch.Tensor, params: SamplingParams, context: list[int], prompt_len: int) -> torch.Tensor:
    """One position's adjusted logits [V], from its own context, in vLLM's order."""
    row = logits.clone().float()
    for token, bias in params.logit_bias:
        row[token] = row[token] + bias
    scores = row[None]
    ids = torch.tensor([context])
    if params.min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, list(params.stop_ids))(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    row = scores[0].clone()
    for token, count in Counter(context[prompt_len:]).items():
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    return row


def reference_probs(logits: torch.Tensor, params: SamplingParams, context: list[int], prompt_len: int) -> torch.Tensor:
    """A position's sampled distribution [V] from its logits and context, none of it by the
    engine's code: the adjustments above, then transformers' temperature, top-k and top-p."""
    scores = reference_row(logits, params, context, prompt_len)[None]
    ids = torch.tensor([context])
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


def reference(logits: torch.Tensor, params: SamplingParams, history: list[int], prompt_len: int) -> torch.Tensor:
    n = logits.shape[0]
    first = len(history) - n + 1
    return torch.stack([reference_row(logits[j], params, history[:first + j], prompt_len) for j in range(n)])


ALL = SamplingParams(temperature=0.7, presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.3,
                     logit_bias=((3, 2.5), (5, -100.0), (11, 0.7)), min_tokens=6, stop_ids=(EOS, STOP))
CASES = {
    "all": ALL,
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=-1.0),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "bias": SamplingParams(logit_bias=((2, 100.0), (9, -3.0))),
    "min_tokens": SamplingParams(min_tokens=4, stop_ids=(EOS, STOP)),
}


def windows(seed: int):
    """(logits, history, prompt_len) of verify windows over a small vocabulary where tokens
    repeat: prompts of 3-8, outputs of 0-6 tokens, then k = 0-5 drafts (k + 1 rows)."""
    rng = random.Random(seed)
    for _ in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 9))]
        output = [rng.randrange(12) for _ in range(rng.randrange(0, 7))]
        k = rng.randrange(0, 6)
        drafts = [rng.randrange(12) for _ in range(k)]
        logits = torch.randn(k + 1, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
        yield logits, prompt + output + drafts, len(prompt)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_row_of_a_window_is_its_own_context_adjusted(case):
    params = CASES[case]
    for logits, history, prompt_len in windows(seed=len(case)):
        got = adjusted_logits(logits, params, history, prompt_len)
        want = reference(logits, params, history, prompt_len)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_min_tokens_masks_the_stop_ids_of_the_rows_before_it_only():
    params = CASES["min_tokens"]
    logits = torch.zeros(6, VOCAB)
    history = [5, 5, 5] + [1, 1] + [2, 2, 2, 2, 2]      # prompt of 3, output of 2, 5 drafts
    out = adjusted_logits(logits, params, history, prompt_len=3)
    masked = torch.isinf(out[:, [EOS, STOP]]).all(-1).tolist()
    assert masked == [True, True, False, False, False, False]   # rows whose output holds 2, 3 (< 4), then 4..7
    assert torch.isfinite(out[:, 1:STOP]).all()


def test_nothing_to_adjust_leaves_the_logits_as_they_are():
    logits = torch.randn(3, VOCAB)
    assert adjusted_logits(logits, SamplingParams(temperature=0.5, top_k=3), [1, 2, 3, 4], 2) is logits
    assert adjusted_logits(logits, SamplingParams(min_tokens=5), [1, 2, 3, 4], 2) is logits   # no stop ids


def test_a_bias_on_a_token_past_a_smaller_vocabulary_is_left_out():
    """A draft model's vocabulary may be smaller than the target's: its rows skip the ids."""
    logits = torch.zeros(1, VOCAB)
    out = adjusted_logits(logits, SamplingParams(logit_bias=((2, 1.0), (VOCAB + 3, 5.0))), [1, 2], 1)
    assert out[0, 2] == 1.0 and out.sum() == 1.0


def test_the_reference_tells_a_window_that_forgets_its_drafts(monkeypatch):
    """Power: penalties counted from the tokens before the window alone, the bug speculation
    invites, disagree with the reference on the rows after a repeated draft."""
    def forgetful(before, window, n, vocab, device):
        return processing._bincount(before, vocab, device)[None].repeat(n, 1)
    monkeypatch.setattr(processing, "_counts", forgetful)
    logits, history, prompt_len = torch.randn(4, VOCAB), [9, 9, 9, 1, 2, 2, 2], 3
    got = adjusted_logits(logits, CASES["frequency"], history, prompt_len)
    want = reference(logits, CASES["frequency"], history, prompt_len)
    assert torch.allclose(got[0], want[0]) and not torch.allclose(got[1:], want[1:])
