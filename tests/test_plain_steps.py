"""A target call of several single-token steps (VerifyRequest.steps, pools.target.decode_steps):
its tokens are the target alone's, checked against Hugging Face's own greedy generate(); it
ends early after a stop id; rows of one batch may ask for different numbers of steps; a
row that fails in a later step keeps the tokens before it. Through HTTP: tests/test_http_greedy_exactness.py
(the target alone), tests/test_openai_dialect.py (logprobs), tests/test_sampling_exactness.py
(the sampled distribution)."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface import TargetEngine
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer
from replicas.protocol import RowError, Verification, VerifyRequest
from replicas.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["import os\n", "def main(argv):\n    parser = argparse.ArgumentParser()\n", "x = 1\n"]


@pytest.fixture(scope="module")
def target(zoo):
    return load_causal_lm(ModelSpec(path=zoo.target)), load_tokenizer(zoo.target)


def hf_greedy(model, ids: list[int], count: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def call(seq_id: str, tokens: list[int], steps: int, **fields) -> VerifyRequest:
    return VerifyRequest(seq_id, tokens, [], None, GREEDY, 0, prompt_len=len(tokens), steps=steps, **fields)


def test_calls_of_several_steps_give_the_target_alones_tokens(target):
    model, tokenizer = target
    engine = TargetEngine.on_model(model, max_cached_tokens=4096)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(model, ids, 12) for ids in prompts]
    sequences = [list(ids) for ids in prompts]
    steps_of = (3, 5, 1)                     # one batch, each row its own number of steps
    while any(len(s) - len(p) < 12 for s, p in zip(sequences, prompts)):
        going = [i for i, (s, p) in enumerate(zip(sequences, prompts)) if len(s) - len(p) < 12]
        answers = engine.verify([call(f"s{i}", sequences[i], min(steps_of[i], 12 - len(sequences[i]) + len(prompts[i])))
                                 for i in going])
        for i, answer in zip(going, answers):
            assert isinstance(answer, Verification) and answer.accepted == 0
            assert len(answer.tokens) == min(steps_of[i], 12 - len(sequences[i]) + len(prompts[i]))
            sequences[i] += answer.tokens
    assert [s[len(p):] for s, p in zip(sequences, prompts)] == expected


def test_a_call_ends_after_a_stop_id(target):
    model, tokenizer = target
    engine = TargetEngine.on_model(model, max_cached_tokens=4096)
    ids = tokenizer.encode(PROMPTS[1])
    expected = hf_greedy(model, ids, 8)
    stop = expected[2]
    [answer] = engine.verify([call("s", ids, 8, stop_ids=(stop,))])
    assert answer.tokens == expected[:expected.index(stop) + 1]
    [whole] = engine.verify([call("t", ids, 8)])
    assert whole.tokens == expected


def test_logprobs_come_for_every_step(target):
    model, tokenizer = target
    engine = TargetEngine.on_model(model, max_cached_tokens=4096)
    ids = tokenizer.encode(PROMPTS[0])
    [answer] = engine.verify([call("s", ids, 4, logprobs=2)])
    assert len(answer.logprobs) == len(answer.tokens) == 4
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids + answer.tokens])).logits[0].float(), -1)
    for position, (entry, token) in enumerate(zip(answer.logprobs, answer.tokens)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(reference[len(ids) - 1 + position, token].item(), abs=1e-4)


def test_a_row_failing_in_a_later_step_keeps_its_earlier_tokens(target, monkeypatch):
    model, tokenizer = target
    engine = TargetEngine.on_model(model, max_cached_tokens=4096)
    ids = tokenizer.encode(PROMPTS[0])
    expected = hf_greedy(model, ids, 2)
    windows = engine._windows

    def failing_later(requests, passes):
        answers = windows(requests, passes)
        if len(requests[0].tokens) > len(ids) + 1:     # its third step on: that row fails
            return [RowError(r.seq_id, "ValueError", "bad numbers") for r in requests]
        return answers
    monkeypatch.setattr(engine, "_windows", failing_later)
    [answer] = engine.verify([call("s", ids, 5)])
    assert isinstance(answer, Verification) and answer.tokens == expected
