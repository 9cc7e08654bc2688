"""Overlapped drafting (router/lookahead.py): a lookahead is used only when its guess held,
with the q rows of the drafts it hands over; sampled tokens that came from a lookahead have
exactly the target's distribution (and a misaligned q is caught); through HTTP, a draft
identical to the target makes every lookahead hold, and the output stays the target's."""

from __future__ import annotations

import pytest
import torch

import router.lookahead as lookahead
from cluster.bench.chi_square import chi_square_p_value
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.protocol import Proposal, ProposeRequest, Verification, VerifyRequest
from router.speculation import round_seed
from tests.conftest import PROMPTS
from tests.http_client import complete
from tests.test_sampling_exactness import ALPHA, PROMPT, SETTINGS, VOCAB
from training.tiny_models import tiny_llama

SAMPLES = 3200
BATCH = 8


def verification(accepted: int, tokens: list[int]) -> Verification:
    return Verification(accepted, tokens, positions_fed=len(tokens), batch_rows=1, model_ms=1.0)


def proposal(tokens: list[int], probs=None) -> Proposal:
    return Proposal(tokens, probs, positions_fed=len(tokens), batch_rows=1.0, model_ms=1.0)


def test_a_lookahead_is_used_only_when_its_guess_held():
    drafts, ahead = [5, 6, 7], proposal([9, 10, 11, 12], torch.eye(4))
    # every draft kept and the bonus token is the guess: the next window's drafts are ready
    ready = lookahead.usable_drafts(drafts, verification(3, [5, 6, 7, 9]), ahead, k_next=3)
    assert ready.tokens == [10, 11, 12] and torch.equal(ready.probs, torch.eye(4)[1:4])
    assert lookahead.usable_drafts(drafts, verification(3, [5, 6, 7, 9]), ahead, k_next=2).tokens == [10, 11]
    # the target added another token after the window: a wrong guess is discarded
    assert lookahead.usable_drafts(drafts, verification(3, [5, 6, 7, 8]), ahead, k_next=3) is None
    # a draft was rejected (the recovered token even equals the guess): discarded
    assert lookahead.usable_drafts(drafts, verification(2, [5, 6, 9]), ahead, k_next=3) is None
    assert lookahead.lookahead_size(4, 10) == 4 and lookahead.lookahead_size(4, 2) == 2
    assert lookahead.lookahead_size(4, -1) == 0


@pytest.fixture(scope="module")
def twins():
    """A target and a draft with the same weights: sampled drafts are always kept, so the
    lookahead holds whenever the guess equals the target's bonus token (often, on 8 tokens)."""
    # Peakier than the sampling tests' pair: the guess holds most of the time, and the next
    # token's distribution moves far with one more token of context (so a q row from the
    # wrong position shows: 5e-13 against 0.9 for the right one, measured).
    target = tiny_llama("target", VOCAB, eos_token_id=0, seed=21, initializer_range=0.5)
    return target, tiny_llama("target", VOCAB, eos_token_id=0, seed=21, initializer_range=0.5)


@torch.inference_mode()
def next_token_probs(target, params) -> torch.Tensor:
    """p(t3 | PROMPT, t1, t2) for every (t1, t2): [V, V, V]."""
    from tests.test_logits_processing import reference_probs
    contexts = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    logits = target(torch.tensor(contexts)).logits[:, -1]
    rows = [reference_probs(row, params, context, len(PROMPT)) for row, context in zip(logits, contexts)]
    return torch.stack(rows).reshape(VOCAB, VOCAB, VOCAB)


def tokens_from_lookaheads(target, draft, params, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's protocol with k = 1, on the engines: round 0 drafts and verifies, and its
    lookahead drafts the guess and one draft after the window; when the guess holds, round 1
    verifies the lookahead's draft. Returns the counts of round 1's first token over those
    samples, and the counts expected under the target: sum over samples of p(. | context)."""
    drafts = DraftEngine.on_model(draft, max_cached_tokens=4096, max_seq_len=16)
    verifier = TargetEngine.on_model(target, max_cached_tokens=4096, max_seq_len=16)
    exact = next_token_probs(target, params)
    counts, expected = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for first in range(0, SAMPLES, BATCH):
        rows = range(first, first + BATCH)
        seeds = {i: seed * 1_000_003 + i for i in rows}
        prompt_len = len(PROMPT)     # the penalties count the output after it
        props = drafts.propose([ProposeRequest(f"s{i}", PROMPT, 1, params, round_seed(seeds[i], 0, "draft"),
                                               prompt_len=prompt_len) for i in rows])
        aheads = drafts.propose([ProposeRequest(f"s{i}", PROMPT + p.tokens, 2, params,
                                                round_seed(seeds[i], 0, "draft-ahead"), prompt_len=prompt_len)
                                 for i, p in zip(rows, props)])
        verdicts = verifier.verify([VerifyRequest(f"s{i}", PROMPT, p.tokens, p.probs, params,
                                                  round_seed(seeds[i], 0, "target"), prompt_len=prompt_len)
                                    for i, p in zip(rows, props)])
        hits = []
        for i, p, ahead, verdict in zip(rows, props, aheads, verdicts):
            ready = lookahead.usable_drafts(p.tokens, verdict, ahead, k_next=1)
            if ready is not None:
                hits.append((i, PROMPT + verdict.tokens, ready))
        answers = verifier.verify([VerifyRequest(f"s{i}", context, ready.tokens, ready.probs, params,
                                                 round_seed(seeds[i], 1, "target"), prompt_len=prompt_len)
                                   for i, context, ready in hits])
        for (_, context, _), answer in zip(hits, answers):
            counts[answer.tokens[0]] += 1
            expected += exact[context[-2], context[-1]]
    return counts, expected


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_tokens_drafted_ahead_have_the_target_distribution(twins, setting):
    target, draft = twins
    counts, expected = tokens_from_lookaheads(target, draft, SETTINGS[setting], seed=3)
    assert counts.sum() > SAMPLES / 10          # the lookahead path was taken often enough to judge
    assert chi_square_p_value(counts, expected / expected.sum()) > ALPHA


def _guess_row_as_q(drafts, verdict, ahead, k_next):
    """A broken hand-over: the drafts' q rows taken one row early (the guess's row)."""
    ready = _usable(drafts, verdict, ahead, k_next)
    if ready is None or ready.probs is None:
        return ready
    return lookahead.Drafts(ready.tokens, ahead.probs[:len(ready.tokens)], ready.proposal)


_usable = lookahead.usable_drafts


def test_the_test_rejects_misaligned_draft_probabilities(twins, monkeypatch):
    # Only a draft paired with a q row it was not sampled from can bias the rule: drafts used
    # in another context than they were drafted for, or handed over without q (one-hot),
    # are still exact. So that is the bug the test must catch.
    target, draft = twins
    monkeypatch.setattr(lookahead, "usable_drafts", _guess_row_as_q)
    counts, expected = tokens_from_lookaheads(target, draft, SETTINGS["plain"], seed=3)
    assert chi_square_p_value(counts, expected / expected.sum()) < ALPHA


def test_a_draft_identical_to_the_target_makes_every_lookahead_hold(apps, greedy_reference):
    for prompt in PROMPTS[:3]:
        out = complete(apps["copy"], prompt, max_tokens=48, speculation={"k": 3})
        spec = out["speculation"]
        assert out["choices"][0]["token_ids"] == greedy_reference(prompt, 48)
        if spec["rounds"] > 2:
            assert spec["lookahead_hit_rate"] == 1.0 and spec["draft_hidden_share"] > 0.3
        off = complete(apps["copy"], prompt, max_tokens=48, speculation={"k": 3, "overlap": False})
        assert off["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]
        assert off["speculation"]["lookahead_hit_rate"] == 0.0 and off["speculation"]["draft_hidden_share"] == 0.0


def test_a_sequence_drafting_ahead_counts_twice_in_the_draft_pools_demand():
    """The draft pool autoscales on the call streams it serves (cluster/autoscaling.py): a
    sequence's lookaheads are a second stream beside its windows, until it is released."""
    import asyncio

    from replicas.batcher import Batcher
    from replicas.deployments import call_stream, release_streams
    from replicas.sampling import SamplingParams

    async def scenario() -> list[int]:
        async def run(calls):
            return [None] * len(calls)
        batcher = Batcher(run, call_stream, max_batch_size=8, wait_s=0.0)
        window = ProposeRequest("s", [1, 2], 3, SamplingParams(), seed=1)
        ahead = ProposeRequest("s", [1, 2, 5, 6, 7], 4, SamplingParams(), seed=2, lookahead=True)
        await batcher.submit(window)
        seen = [batcher.active_sequences]
        await asyncio.gather(batcher.submit(window), batcher.submit(ahead))
        seen.append(batcher.active_sequences)
        release_streams(batcher, "s")
        return seen + [batcher.active_sequences]

    assert asyncio.run(scenario()) == [1, 2, 0]


def test_the_draft_pool_serves_exactly_the_lookaheads_the_router_sent(apps):
    import time

    from ray import serve

    draft = serve.get_deployment_handle("draft", app_name="spec-copy")

    def served() -> int:
        return draft.describe.remote().result()["lookahead_calls"]

    before = served()
    on = complete(apps["copy"], PROMPTS[1], max_tokens=48, speculation={"k": 3})["speculation"]
    assert on["lookaheads"] >= on["rounds"] - 1      # every round that leaves room for one more window
    deadline = time.monotonic() + 10
    while served() != before + on["lookaheads"] and time.monotonic() < deadline:
        time.sleep(0.1)                              # the last lookahead may still be on its way
    assert served() == before + on["lookaheads"]
    off = complete(apps["copy"], PROMPTS[1], max_tokens=48, speculation={"k": 3, "overlap": False})["speculation"]
    assert off["lookaheads"] == 0 and served() == before + on["lookaheads"]


def test_auto_overlap_drafts_ahead_where_windows_hold_and_stays_exact(ray_serve, zoo, greedy_reference):
    """With overlap: auto, a round drafts ahead where the controller expects the draft call
    it saves to pay (router/k_control.py): with a draft that copies the target every window
    and guess holds, so it does; every output is the target's."""
    from tests.conftest import cluster_config, deploy

    config = cluster_config(zoo.target, zoo.drafts["copy"], speculation={"overlap": "auto", "k": 3, "min_k": 3,
                                                                          "max_k": 3})
    url = deploy(ray_serve, "auto-overlap", config)
    try:
        sent = []
        for prompt in PROMPTS[:6]:
            out = complete(url, prompt, max_tokens=48)
            assert out["choices"][0]["token_ids"] == greedy_reference(prompt, 48)
            sent.append(out["speculation"]["lookaheads"])
        assert max(sent) > 0
    finally:
        from ray import serve
        serve.delete("auto-overlap")
