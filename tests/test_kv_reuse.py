"""A replica that holds a sequence's KV cache computes only the new positions; one that lost
it rebuilds from the token ids in the call and gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.engines.huggingface.kv_cache import KVCacheStore
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner, common_prefix_length
from replicas.protocol import ProposeRequest, VerifyRequest
from replicas.sampling import GREEDY, SamplingParams
from training.tiny_models import perturbed_copy, tiny_llama

VOCAB = 64
PROMPT = list(range(5, 25))  # 20 positions


@pytest.fixture(scope="module")
def models():
    target = tiny_llama("target", VOCAB, eos_token_id=0, seed=3)
    return target, perturbed_copy(target, 0.02, seed=4)


def verify(engine: TargetEngine, tokens, drafts, seq_id="s", sampling=GREEDY, probs=None, seed=0):
    [verdict] = engine.verify([VerifyRequest(seq_id, tokens, drafts, probs, sampling, seed)])
    return verdict


def test_verify_feeds_only_new_positions_when_the_cache_is_held(models):
    target, _ = models
    engine = TargetEngine.on_model(target, max_cached_tokens=1000)
    first = verify(engine, PROMPT, [7, 8, 9])
    assert first.positions_fed == len(PROMPT) + 3  # a new sequence: everything
    tokens = PROMPT + first.tokens
    second = verify(engine, tokens, [1, 2, 3, 4])
    assert second.positions_fed == 1 + 4  # its last token and the drafts
    plain = verify(engine, tokens + second.tokens, [])
    assert plain.positions_fed == 1


def test_a_replica_without_the_cache_gives_the_same_tokens(models):
    target, draft = models
    holder, drafter = TargetEngine.on_model(target, max_cached_tokens=1000), DraftEngine.on_model(draft, max_cached_tokens=1000)
    tokens = list(PROMPT)
    tokens += verify(holder, tokens, []).tokens  # the holder now caches the prompt
    for _ in range(6):
        [proposal] = drafter.propose([ProposeRequest("s", tokens, 4, GREEDY, seed=0)])
        held = verify(holder, tokens, proposal.tokens)
        fresh = verify(TargetEngine.on_model(target, max_cached_tokens=1000), tokens, proposal.tokens)
        assert fresh.positions_fed == len(tokens) + 4 > held.positions_fed
        assert (fresh.accepted, fresh.tokens) == (held.accepted, held.tokens)
        tokens += held.tokens


def test_released_or_evicted_caches_are_rebuilt(models):
    target, _ = models
    engine = TargetEngine.on_model(target, max_cached_tokens=25)
    before = verify(engine, PROMPT, [1, 2], seq_id="a")  # 22 cached positions
    verify(engine, PROMPT[:10], [3], seq_id="b")  # 11 more: over budget, so "a" is evicted
    again = verify(engine, PROMPT, [1, 2], seq_id="a")
    assert again.positions_fed == len(PROMPT) + 2
    assert again.tokens == before.tokens
    engine.release("a")
    assert "a" not in engine.runner.caches


def test_sampled_verify_is_the_same_with_or_without_the_cache(models):
    target, draft = models
    params = SamplingParams(temperature=0.9)
    drafter = DraftEngine.on_model(draft, max_cached_tokens=1000)
    [proposal] = drafter.propose([ProposeRequest("s", PROMPT, 4, params, seed=5)])
    assert proposal.probs is not None and tuple(proposal.probs.shape) == (4, VOCAB)
    holder = TargetEngine.on_model(target, max_cached_tokens=1000)
    verify(holder, PROMPT[:-3], [], sampling=params)  # warm a shorter prefix of the cache
    held = verify(holder, PROMPT, proposal.tokens, sampling=params, probs=proposal.probs, seed=9)
    fresh = verify(TargetEngine.on_model(target, max_cached_tokens=1000), PROMPT, proposal.tokens,
                   sampling=params, probs=proposal.probs, seed=9)
    assert held.positions_fed < fresh.positions_fed
    assert held.tokens == fresh.tokens


def test_draft_reuses_its_cache_across_rounds(models):
    _, draft = models
    engine = DraftEngine.on_model(draft, max_cached_tokens=1000)
    [first] = engine.propose([ProposeRequest("s", PROMPT, 4, GREEDY, seed=0)])
    assert first.positions_fed == len(PROMPT) + 3  # prompt, then one position per later step
    accepted = first.tokens[:2] + [11]  # two drafts kept, then the target's own token
    [second] = engine.propose([ProposeRequest("s", PROMPT + accepted, 4, GREEDY, seed=0)])
    assert second.positions_fed == 1 + 3  # only the target's token is new, then 3 steps
    # The cache's own account, which the vLLM target's test reads through describe().
    described = engine.describe()
    assert described["computed_positions"] == first.positions_fed + second.positions_fed
    n = len(PROMPT)   # each step keeps all it is given but its newest position(s)
    assert described["reused_positions"] == (0 + n + (n + 1) + (n + 2)) + ((n + 2) + (n + 3) + (n + 4) + (n + 5))


def test_common_prefix_and_token_budget_lru():
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_length([], [1]) == 0
    store = KVCacheStore(max_tokens=10, max_seq_len=2)          # 5 slots
    for seq_id, token in (("a", 1), ("b", 2)):
        slots, _ = store.place([seq_id], {})
        store.commit(seq_id, [token] * 4, slots[seq_id])
    store.get("a")                               # "b" is now least recently used
    slots, _ = store.place(["c"], {})
    store.commit("c", [3] * 4, slots["c"])       # 12 > 10 tokens: "b" goes
    assert "b" not in store and "a" in store and "c" in store and store.cached_tokens == 8
    slots, _ = store.place(["d"], {})
    store.commit("d", [4] * 11, slots["d"])      # longer than the whole budget: not kept
    assert "d" not in store and store.cached_tokens == 8

@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in-a-batch"])
def test_a_call_that_diverges_well_before_its_end_reuses_only_the_common_prefix(models, batched):
    # The cache holds PROMPT + [7, 8, 9, 10, 11]; the call keeps PROMPT + [7] and then goes
    # elsewhere (as after rejected drafts, an overlapped window or a rebuilt cache): only the
    # first len(PROMPT) + 1 positions may be reused. Reusing one more passes every other test.
    target, _ = models
    runner = ModelRunner(target, max_cached_tokens=1000, max_seq_len=64)   # room for 15 sequences
    runner.extend("s", PROMPT + [7, 8, 9, 10, 11], 1)
    diverged = PROMPT + [7, 30, 31, 32, 33]
    calls = [ExtendCall("s", diverged, 2)] + ([ExtendCall("other", [3, 4, 5, 6] * 4, 1)] if batched else [])
    held = runner.extend_batch(calls)[0]
    fresh = ModelRunner(target, max_cached_tokens=1000).extend("s", diverged, 2)
    assert held.positions_fed == 4                      # 30..33: the four that differ
    assert torch.allclose(held.logits, fresh.logits, atol=1e-5)
    again = runner.extend("s", diverged, 2)             # the cache now holds the diverged tokens
    assert again.positions_fed == 2 and torch.allclose(again.logits, fresh.logits, atol=1e-5)
