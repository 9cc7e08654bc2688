"""Sampled speculation has exactly the target's distribution.

On a tiny-vocabulary pair the joint distribution of the first two generated tokens is known
exactly by enumeration (V * V cells), each position's distribution built apart from the code
under test: transformers' temperature, top-k and top-p warpers and its repetition penalty,
and vLLM's logit bias and frequency and presence penalties written out token by token
(tests/test_logits_processing.py). Speculative samples from the real engines are compared
with it by a chi-square goodness-of-fit test at significance ALPHA: a correct sampler fails
it with probability ALPHA (0.1 %) for a random seed; the seeds here are fixed, so the outcome
is deterministic. The same test must reject deliberately wrong acceptance and residual rules,
which shows that it has the power to catch a broken sampler.
"""

from __future__ import annotations

import copy

import pytest
import torch

import replicas.logits_processing as processing
import replicas.speculative as speculative
from cluster.bench.chi_square import chi_square_p_value
from cluster.config import ModelSpec
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.engines.huggingface.shard_group import launch_local
from replicas.protocol import ProposeRequest, VerifyRequest
from replicas.sampling import SamplingParams
from training.tiny_models import tiny_llama
from replicas.drafting.lookup import lookup_drafts
from replicas.drafting.suffix import OutputCache, suffix_drafts
from router.speculation import round_seed
from tests.test_logits_processing import reference_probs

VOCAB = 8
PROMPT = [1, 2, 3]
SAMPLES = 2000
BROKEN_RULE_SAMPLES = 1000  # gross errors need fewer samples to show
K = 3
BATCH = 8
ALPHA = 1e-3
SETTINGS = {
    "plain": SamplingParams(temperature=1.0),
    "warped": SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
}
# Only through the main engine test (each setting costs seconds of the suite's budget).
MORE_SETTINGS = {
    "top_k": SamplingParams(temperature=1.2, top_k=3),     # in "warped" top_p cuts deeper than top_k
    # the second token's distribution depends on the first (a draft of the same window, often)
    "penalised": SamplingParams(temperature=0.9, frequency_penalty=1.2, logit_bias=((3, 1.5), (5, -1.0))),
}


@pytest.fixture(scope="module")
def pair():
    # Both spread over all 8 tokens (largest first-token probability about 0.33), and far
    # apart: total variation about 0.45 on the first token.
    target = tiny_llama("target", VOCAB, eos_token_id=0, seed=21, initializer_range=0.15)
    draft = tiny_llama("draft", VOCAB, eos_token_id=0, seed=22, initializer_range=0.15)
    return target, draft


@torch.inference_mode()
def exact_joint(target, params: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(t1, t2 | prompt) [V, V], by enumerating t1 with full forward passes (no cache)."""
    first = reference_probs(target(torch.tensor([prompt])).logits[0, -1].float(), params, prompt, len(prompt))   # [V]
    seconds = target(torch.tensor([prompt + [t] for t in range(VOCAB)])).logits[:, -1].float()                   # [V, V]
    second = torch.stack([reference_probs(seconds[t], params, prompt + [t], len(prompt)) for t in range(VOCAB)])
    return first[:, None] * second


def speculative_pairs(target, draft, params: SamplingParams, seed: int,
                      samples: int = SAMPLES, verifier: TargetEngine | None = None,
                      k_of=lambda round_index, i: K, seeded: bool = False, steps: int = 1,
                      drafts: DraftEngine | None = None) -> torch.Tensor:
    """Counts [V, V] of the first two tokens of `samples` speculative generations, run BATCH
    at a time through the batched engines (rows diverge in length after the first round, so
    the padded batch layout is part of what is tested). `verifier` defaults to the target
    in this process (`drafts` the draft's likewise); sequence i drafts k_of(round, i) tokens in a round (0: the target alone).
    `seeded`: each sequence sampled by Gumbel-max with public noise of its own seed
    (replicas/gumbel.py), as a request with a seed is. `steps`: each verify call runs that many
    forward passes (VerifyRequest.steps), its further tokens the target alone's."""
    drafts = drafts or DraftEngine.on_model(draft, max_cached_tokens=1000)
    verifier = verifier or TargetEngine.on_model(target, max_cached_tokens=1000)
    counts = torch.zeros(VOCAB, VOCAB)
    for first in range(0, samples, BATCH):
        sequences = {i: list(PROMPT) for i in range(first, min(first + BATCH, samples))}
        round_index = 0
        while unfinished := [i for i, tokens in sequences.items() if len(tokens) < len(PROMPT) + 2]:
            seeds = {i: seed * 1_000_003 + i for i in unfinished}
            noise = {i: seeds[i] if seeded else None for i in unfinished}
            proposals = drafts.propose([ProposeRequest(
                f"s{i}", sequences[i], k_of(round_index, i), params, round_seed(seeds[i], round_index, "draft"),
                noise_seed=noise[i], prompt_len=len(PROMPT)) for i in unfinished])
            verdicts = verifier.verify([VerifyRequest(
                f"s{i}", sequences[i], proposal.tokens, proposal.probs, params,
                round_seed(seeds[i], round_index, "target"), noise_seed=noise[i], prompt_len=len(PROMPT),
                steps=steps) for i, proposal in zip(unfinished, proposals)])
            for i, verdict in zip(unfinished, verdicts):
                sequences[i] += verdict.tokens
            round_index += 1
        for tokens in sequences.values():
            counts[tokens[len(PROMPT)], tokens[len(PROMPT) + 1]] += 1
    return counts


def test_the_pair_disagrees_enough_to_matter(pair):
    """The draft's own distribution is far from the target's, so only a correct rule passes."""
    target, draft = pair
    params = SETTINGS["plain"]
    total_variation = 0.5 * (exact_joint(target, params) - exact_joint(draft, params)).abs().sum()
    assert total_variation > 0.4


@pytest.mark.parametrize("setting", sorted(SETTINGS | MORE_SETTINGS))
def test_speculative_sampling_matches_target_distribution(pair, setting):
    target, draft = pair
    params = (SETTINGS | MORE_SETTINGS)[setting]
    counts = speculative_pairs(target, draft, params, seed=1)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_draft_q_cut_to_its_top_entries_keeps_the_target_distribution(pair, setting):
    """The draft pool ships q as its top entries (replicas/draft_probs.py): cut to 3 of the 8
    tokens, the draft samples from what it ships, and the rule stays exact."""
    target, draft = pair
    params = SETTINGS[setting]
    drafts = DraftEngine.on_model(draft, max_cached_tokens=1000, probs_top=3)
    proposal = drafts.propose([ProposeRequest("q", PROMPT, K, params, seed=5)])[0]
    assert tuple(proposal.probs.ids.shape) == (K, 3) and tuple(proposal.probs.shape) == (K, VOCAB)
    counts = speculative_pairs(target, draft, params, seed=3, drafts=drafts)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


def test_the_test_rejects_a_draft_that_samples_from_another_q_than_it_ships(pair, monkeypatch):
    """Sampling from the whole q while shipping its top 3 entries: the test has the power."""
    target, draft = pair
    params = SETTINGS["plain"]
    monkeypatch.setattr("replicas.engines.huggingface.engine.cut_to_top", lambda q, top: q)
    drafts = DraftEngine.on_model(draft, max_cached_tokens=1000, probs_top=3)
    counts = speculative_pairs(target, draft, params, seed=3, samples=BROKEN_RULE_SAMPLES, drafts=drafts)
    assert chi_square_p_value(counts, exact_joint(target, params)) < ALPHA


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_speculative_sampling_on_the_fused_cpu_forward_matches_target_distribution(pair, setting):
    """Both engines on the fused forward (`compile: auto` on a CPU, fused_cpu.py); the
    reference is transformers' modules' exact joint."""
    target, draft = pair
    params = SETTINGS[setting]
    verifier = TargetEngine.on_model(target, max_cached_tokens=1000, fused_cpu=True)
    drafts = DraftEngine.on_model(draft, max_cached_tokens=1000, fused_cpu=True)
    assert verifier.runner.fused and drafts.runner.fused
    counts = speculative_pairs(target, draft, params, seed=7, verifier=verifier, drafts=drafts)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


def test_speculative_sampling_in_bfloat16_matches_the_bfloat16_target(pair):
    """The engines' bfloat16 path (batch-invariant attention, tests/test_reduced_precision.py)."""
    target, draft = (copy.deepcopy(model).to(torch.bfloat16) for model in pair)
    params = SETTINGS["warped"]
    counts = speculative_pairs(target, draft, params, seed=5)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_sampling_matches_target_distribution_while_k_changes_every_round(pair, setting):
    """As the adaptive choice does: k differs between rounds and between the batch's rows."""
    target, draft = pair
    params = SETTINGS[setting]
    counts = speculative_pairs(target, draft, params, seed=3, k_of=lambda r, i: (r + i) % 4)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


@pytest.mark.parametrize("setting", ["plain", "penalised"])
def test_the_target_alone_in_one_call_of_two_steps_matches_its_distribution(pair, setting):
    """A round without drafts whose call runs two forward passes (pools.target.decode_steps):
    both tokens come from that one call, the second sampled on the first (penalties included)."""
    target, draft = pair
    params = (SETTINGS | MORE_SETTINGS)[setting]
    [one_call] = TargetEngine.on_model(target, max_cached_tokens=100).verify(
        [VerifyRequest("one", PROMPT, [], None, params, 7, prompt_len=len(PROMPT), steps=2)])
    assert len(one_call.tokens) == 2
    counts = speculative_pairs(target, draft, params, seed=4, k_of=lambda r, i: 0, steps=2)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


# A prompt that repeats itself, so that prompt lookup finds drafts in the first round (3, 1, 2)
# and, after most first tokens, in the second.
REPEATING = [1, 2, 3, 1, 2]


def lookup_pairs(target, params: SamplingParams, seed: int, wrong_q: bool = False,
                 method: str = "ngram") -> torch.Tensor:
    """Counts [V, V] of the first two tokens after REPEATING, with drafts from prompt lookup
    (replicas/drafting/lookup.py), verified as the router sends them: no draft_probs, so q is one-hot.
    wrong_q: send a uniform q instead, as if the drafts had been sampled from it. method
    "suffix": suffix drafts (replicas/drafting/suffix.py), their output cache fed every earlier batch's
    samples, as a router's is fed earlier requests' outputs."""
    verifier = TargetEngine.on_model(target, max_cached_tokens=1000)
    counts, looked_up = torch.zeros(VOCAB, VOCAB), 0
    outputs = OutputCache(max_tokens=4096)

    def drafter(tokens: list[int]) -> list[int]:
        return suffix_drafts(tokens, K, outputs) if method == "suffix" else lookup_drafts(tokens, K)

    for first in range(0, SAMPLES, BATCH):
        sequences = {i: list(REPEATING) for i in range(first, min(first + BATCH, SAMPLES))}
        round_index = 0
        while unfinished := [i for i, tokens in sequences.items() if len(tokens) < len(REPEATING) + 2]:
            drafts = {i: drafter(sequences[i]) for i in unfinished}
            looked_up += sum(len(d) for d in drafts.values())
            verdicts = verifier.verify([VerifyRequest(
                f"s{i}", sequences[i], drafts[i], torch.full((len(drafts[i]), VOCAB), 1 / VOCAB) if wrong_q else None,
                params, round_seed(seed * 1_000_003 + i, round_index, "target"), prompt_len=len(REPEATING))
                for i in unfinished])
            for i, verdict in zip(unfinished, verdicts):
                sequences[i] += verdict.tokens
            round_index += 1
        for tokens in sequences.values():
            counts[tokens[len(REPEATING)], tokens[len(REPEATING) + 1]] += 1
            outputs.add(REPEATING, tokens[len(REPEATING):])
    assert looked_up >= SAMPLES * K       # every first round drafted 3 tokens
    return counts


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_prompt_lookup_drafts_keep_the_target_distribution(pair, setting):
    target, _ = pair
    params = SETTINGS[setting]
    counts = lookup_pairs(target, params, seed=5)
    assert chi_square_p_value(counts, exact_joint(target, params, REPEATING)) > ALPHA


def test_suffix_drafts_from_earlier_samples_keep_the_target_distribution(pair):
    """Drafts that depend on other requests' samples are still fixed before the round: q one-hot."""
    target, _ = pair
    params = SETTINGS["plain"]
    counts = lookup_pairs(target, params, seed=6, method="suffix")
    assert chi_square_p_value(counts, exact_joint(target, params, REPEATING)) > ALPHA


def test_the_test_rejects_lookup_drafts_verified_with_a_wrong_q(pair):
    """Power: the same drafts checked as if sampled from a uniform q (acceptance min(1, V p))."""
    target, _ = pair
    params = SETTINGS["plain"]
    counts = lookup_pairs(target, params, seed=5, wrong_q=True)
    assert chi_square_p_value(counts, exact_joint(target, params, REPEATING)) < ALPHA


@pytest.fixture(scope="module")
def sharded_verifier(pair, tmp_path_factory):
    """The pair's target as a tensor-parallel group of 2 shards (this process is rank 0)."""
    target, _ = pair
    folder = tmp_path_factory.mktemp("tp-pair") / "target"
    target.save_pretrained(folder)
    runner = launch_local(ModelSpec(path=folder), max_cached_tokens=1000, world=2)
    yield TargetEngine(runner)
    runner.close()


def test_sampling_on_the_tensor_parallel_engine_matches_target_distribution(pair, sharded_verifier):
    # One setting: the shards' logits equal the unsharded ones (tests/test_tensor_parallel.py)
    # and the warped settings run the same rule above; this is the sharded engine end to end.
    target, draft = pair
    params = SETTINGS["plain"]
    counts = speculative_pairs(target, draft, params, seed=2, verifier=sharded_verifier)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


def _always_accept(p_x, q_x):
    return torch.ones(())


def _inverted_ratio(p_x, q_x):
    return torch.clamp(q_x / p_x, max=1.0)


def _resample_from_target(p, q):
    return p


def test_the_test_rejects_penalties_that_forget_the_window(pair, monkeypatch):
    """Power: counting the output before the window only, so that a draft of the window is not
    penalised at the positions after it, is the bug speculation invites; it fails."""
    target, draft = pair
    params = MORE_SETTINGS["penalised"]
    monkeypatch.setattr(processing, "_counts",
                        lambda before, window, n, vocab, device: processing._bincount(before, vocab, device)[None]
                        .repeat(n, 1))
    counts = speculative_pairs(target, draft, params, seed=1, samples=BROKEN_RULE_SAMPLES)
    assert chi_square_p_value(counts, exact_joint(target, params)) < ALPHA


def test_the_chi_square_helper_refuses_a_single_cell():
    with pytest.raises(AssertionError, match="one cell"):
        chi_square_p_value(torch.tensor([[10.0, 0.0], [0.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize("rule,broken", [
    ("acceptance_probability", _always_accept),
    ("acceptance_probability", _inverted_ratio),
    ("residual_distribution", _resample_from_target),
])
def test_the_test_rejects_a_wrong_rule(pair, monkeypatch, rule, broken):
    target, draft = pair
    params = SETTINGS["plain"]
    monkeypatch.setattr(speculative, rule, broken)
    counts = speculative_pairs(target, draft, params, seed=1, samples=BROKEN_RULE_SAMPLES)
    assert chi_square_p_value(counts, exact_joint(target, params)) < ALPHA
