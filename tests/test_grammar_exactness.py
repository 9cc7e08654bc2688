"""Speculation under a grammar gives exactly the target's masked distribution.

An 8-token vocabulary ("a".."g" and end of text) and the regex `[a-d][a-g]`: the first token
is one of a-d, the second one of a-g, then end of text. The reference masks the target's
logits by that rule written out here (not by llguidance) and enumerates the joint of the
first two tokens, as tests/test_sampling_exactness.py does unmasked; the engines under test
apply llguidance's masks (replicas/grammar.py) to the target's and the draft's rows, with
drafts the grammar forbids among the windows (the draft model proposes masked; lookup-like
drafts of fixed tokens do not). A draft engine that samples from its masked q but reports
its unmasked q to the target's rule failed both sampled tests (p 1e-65 and 1e-124), tried."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cluster.bench.chi_square import chi_square_p_value
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.grammar import GrammarMasks
from replicas.protocol import VerifyRequest
from replicas.sampling import SamplingParams
from router.speculation import round_seed
from tests.test_logits_processing import reference_probs
from tests.test_sampling_exactness import ALPHA, PROMPT, VOCAB, speculative_pairs
from training.tiny_models import tiny_llama

LETTERS = "abcdefg"
FIRST, SECOND = {1, 2, 3, 4}, {1, 2, 3, 4, 5, 6, 7}     # token ids the regex allows at each place
SETTINGS = {"plain": SamplingParams(temperature=1.0), "warped": SamplingParams(temperature=0.8, top_k=6, top_p=0.9)}


@pytest.fixture(scope="module")
def grammar() -> str:
    import llguidance
    return llguidance.LLMatcher.grammar_from_regex("[a-d][a-g]")


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """A tokenizer of one token per letter, end of text 0, as a model folder holds it."""
    vocab = {"<|endoftext|>": 0, **{letter: i + 1 for i, letter in enumerate(LETTERS)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("letters")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair():
    return (tiny_llama("target", VOCAB, eos_token_id=0, seed=21, initializer_range=0.15),
            tiny_llama("draft", VOCAB, eos_token_id=0, seed=22, initializer_range=0.15))


def masked(logits: torch.Tensor, allowed: set[int]) -> torch.Tensor:
    return logits.masked_fill(~torch.isin(torch.arange(VOCAB), torch.tensor(sorted(allowed))), float("-inf"))


@torch.inference_mode()
def exact_masked_joint(target, params: SamplingParams) -> torch.Tensor:
    first = reference_probs(masked(target(torch.tensor([PROMPT])).logits[0, -1].float(), FIRST), params,
                            PROMPT, len(PROMPT))
    seconds = target(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1].float()
    second = torch.stack([reference_probs(masked(seconds[t], SECOND), params, PROMPT + [t], len(PROMPT))
                          for t in range(VOCAB)])
    return first[:, None] * second


def engines(pair, letters):
    target, draft = pair
    return (TargetEngine.on_model(target, max_cached_tokens=1000, grammars=GrammarMasks(letters)),
            DraftEngine.on_model(draft, max_cached_tokens=1000, grammars=GrammarMasks(letters)))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_sampled_speculation_under_a_grammar_has_the_targets_masked_distribution(pair, letters, grammar, setting):
    params = dataclasses.replace(SETTINGS[setting], grammar=grammar)
    verifier, drafts = engines(pair, letters)
    counts = speculative_pairs(*pair, params, seed=11, verifier=verifier, drafts=drafts,
                               k_of=lambda r, i: (r + i) % 4)
    assert counts[[t for t in range(VOCAB) if t not in FIRST]].sum() == 0
    assert counts[:, [t for t in range(VOCAB) if t not in SECOND]].sum() == 0
    assert chi_square_p_value(counts, exact_masked_joint(pair[0], dataclasses.replace(params, grammar=None))) > ALPHA


def test_drafts_the_grammar_forbids_are_rejected_and_the_rest_is_the_masked_target(pair, letters, grammar):
    """Windows of fixed drafts (as lookup sends them, q one-hot) that break the grammar at
    each place, greedy and sampled: the output always follows it, and greedy equals the
    masked argmax of the target alone."""
    target, _ = pair
    verifier, _ = engines(pair, letters)
    with torch.inference_mode():
        first = int(masked(target(torch.tensor([PROMPT])).logits[0, -1], FIRST).argmax())
        second = int(masked(target(torch.tensor([PROMPT + [first]])).logits[0, -1], SECOND).argmax())
    greedy = SamplingParams(temperature=0.0, grammar=grammar)
    for n, window in enumerate([[7, 1, 1], [first, 0, 0], [first, second, 5], [first, second, 0], [6], []]):
        params = greedy if n % 2 == 0 else dataclasses.replace(SETTINGS["plain"], grammar=grammar)
        [verdict] = verifier.verify([VerifyRequest(f"w{n}", PROMPT, window, None, params,
                                                   round_seed(n, 0, "target"), prompt_len=len(PROMPT), steps=3)])
        out = verdict.tokens
        assert out[0] in FIRST and (len(out) < 2 or out[1] in SECOND) and (len(out) < 3 or out[2] == 0), (window, out)
        if params is greedy:
            assert out[:3] == [first, second, 0], (window, out)
