"""vLLM's dialect of the OpenAI API on a real served app, speculation on: each field's meaning
(ignore_eos, min_tokens, logprobs, echo, n, logit_bias, stop_token_ids, several prompts,
continuous usage stats), logprobs checked against a Hugging Face forward pass of the target,
and the request bodies GuideLLM sends.

The tiny test tokenizer has 512 ids, 0 being EOS (tests/conftest.py).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer

MODEL = "specserve"
EOS = 0
PROMPT = "class Parser:\n    def __init__(self, text):\n"
TIMEOUT = 120
C, CHAT = "/v1/completions", "/v1/chat/completions"


def post(url: str, path: str, **fields) -> dict:
    body = {"model": MODEL, "temperature": 0, "speculation": {"k": 3}, **fields}
    if path == C:
        body.setdefault("prompt", PROMPT)
    else:
        body.setdefault("messages", [{"role": "user", "content": PROMPT}])
    response = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def complete(url: str, **fields) -> dict:
    return post(url, C, return_token_ids=True, **fields)


def only(response: dict) -> dict:
    [choice] = response["choices"]
    return choice


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, **body, "stream": True},
                      timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                chunks.append(chunk)
    return chunks


@pytest.fixture(scope="module")
def hf(zoo):
    return load_causal_lm(ModelSpec(path=zoo.target)), load_tokenizer(zoo.target)


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) rows [len - 1, V] of one plain forward pass."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def test_ignore_eos_gives_exactly_max_tokens(apps):
    eos_first = {"logit_bias": {str(EOS): 100}}       # EOS is the greedy token everywhere
    ended = only(complete(apps["perturbed"], max_tokens=12, **eos_first))
    assert ended["token_ids"] == [EOS] and ended["finish_reason"] == "stop"
    full = only(complete(apps["perturbed"], max_tokens=12, ignore_eos=True, **eos_first))
    assert len(full["token_ids"]) == 12 and full["finish_reason"] == "length"


def test_min_tokens_holds_off_eos_and_stop_strings(apps):
    url = apps["perturbed"]
    held = only(complete(url, max_tokens=20, min_tokens=5, logit_bias={str(EOS): 100}))
    # EOS masked for the first five, then the greedy token again
    assert held["token_ids"][5] == EOS and len(held["token_ids"]) == 6 and held["finish_reason"] == "stop"
    no_eos = only(complete(url, max_tokens=5, logit_bias={str(EOS): -100}))
    assert held["token_ids"][:5] == no_eos["token_ids"]
    plain = only(complete(url, max_tokens=16))
    stop = plain["text"][:1]
    assert only(complete(url, max_tokens=16, stop=[stop]))["text"] == ""
    late = only(complete(url, max_tokens=16, stop=[stop], min_tokens=6))
    assert len(late["token_ids"]) >= 6 and late["text"].startswith(plain["text"][:1])


@pytest.mark.parametrize("regime, speculation", [("perturbed", None), ("unrelated", None),
                                                 ("perturbed", {"enabled": False})],
                         ids=["perturbed", "unrelated", "target-alone"])
def test_completion_logprobs_are_the_targets_raw_ones(apps, hf, regime, speculation):
    """Speculating, and the target alone (several tokens per target call, pools.target.decode_steps)."""
    model, tokenizer = hf
    extra = {} if speculation is None else {"speculation": speculation}
    choice = only(complete(apps[regime], max_tokens=16, logprobs=3, **extra))
    logprobs, ids = choice["logprobs"], choice["token_ids"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids) == 16
    reference = hf_logprobs(model, tokenizer.encode(PROMPT) + ids)[-len(ids):]        # [16, V]
    expected = reference.gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), expected, atol=1e-4)
    for top, row in zip(logprobs["top_logprobs"], reference):
        values = list(top.values())
        assert len(top) in (3, 4)                     # and the token itself, when not among the three
        assert values[:3] == sorted(values[:3], reverse=True)
        assert torch.allclose(torch.tensor(values[:3]), row.topk(3).values, atol=1e-4)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_chat_logprobs_have_one_entry_per_token_most_likely_first(apps):
    response = post(apps["perturbed"], CHAT, max_tokens=10, logprobs=True, top_logprobs=2)
    content = only(response)["logprobs"]["content"]
    assert len(content) == response["usage"]["completion_tokens"] == 10
    for entry in content:
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(top) == 2 and top == sorted(top, reverse=True) and entry["logprob"] <= top[0] + 1e-6
        assert entry["bytes"] == list(entry["token"].encode())
    assert only(post(apps["perturbed"], CHAT, max_tokens=3))["logprobs"] is None


def test_echo_returns_the_prompt_with_its_logprobs(apps, hf):
    model, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPT)
    choice = only(complete(apps["copy"], max_tokens=4, echo=True, logprobs=1))
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ids = prompt_ids + choice["token_ids"]
    expected = hf_logprobs(model, ids).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:]), expected, atol=1e-4)
    assert only(complete(apps["copy"], max_tokens=4, echo=True))["text"].startswith(PROMPT)


def test_n_choices_differ_when_sampled_and_repeat_with_a_seed(apps):
    url = apps["perturbed"]
    fields = {"n": 4, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    first = complete(url, **fields)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    texts = [c["token_ids"] for c in first["choices"]]
    assert len({tuple(t) for t in texts}) > 1
    assert [c["token_ids"] for c in complete(url, **fields)["choices"]] == texts
    assert first["usage"]["completion_tokens"] == sum(map(len, texts))
    greedy = complete(url, n=2, max_tokens=8)["choices"]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]


def test_best_of_returns_the_samples_with_the_highest_logprob_per_token(apps):
    """best_of=4, n=2 samples the same four seeded choices as n=4 and returns the two whose
    tokens have the highest mean logprob (read from the n=4 response's logprobs, which
    test_completion_logprobs_are_the_targets_raw_ones checks against a HF forward)."""
    url = apps["perturbed"]
    fields = {"max_tokens": 10, "temperature": 1.0, "seed": 11}
    samples = complete(url, n=4, logprobs=0, **fields)
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["token_ids"]) for c in samples["choices"]]
    assert len(set(means)) == 4
    best = complete(url, n=2, best_of=4, **fields)
    ranked = sorted(range(4), key=lambda i: -means[i])[:2]
    assert [c["token_ids"] for c in best["choices"]] == [samples["choices"][i]["token_ids"] for i in ranked]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])    # ranked by them, not asked for
    assert best["usage"] == samples["usage"]                       # every sample's tokens count


def test_logit_bias_against_the_greedy_token_changes_it_exactly_as_the_target_alone(apps):
    url = apps["perturbed"]
    first = only(complete(url, max_tokens=8))["token_ids"][0]
    bias = {"logit_bias": {str(first): -100}}
    biased = only(complete(url, max_tokens=8, **bias))
    assert biased["token_ids"][0] != first and first not in biased["token_ids"]
    alone = only(complete(url, max_tokens=8, speculation={"enabled": False}, **bias))
    assert biased["token_ids"] == alone["token_ids"]


def test_stop_token_ids_stop_there(apps):
    url = apps["perturbed"]
    plain = only(complete(url, max_tokens=16))["token_ids"]
    at = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])
    stopped = only(complete(url, max_tokens=16, stop_token_ids=[plain[at]]))
    assert stopped["token_ids"] == plain[:at + 1] and stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == plain[at]
    assert stopped["text"] == only(complete(url, max_tokens=at))["text"]          # its text left out
    kept = only(complete(url, max_tokens=16, stop_token_ids=[plain[at]], include_stop_str_in_output=True))
    assert kept["text"] == only(complete(url, max_tokens=at + 1))["text"]


def test_several_prompts_give_a_choice_each_in_order(apps, hf):
    _, tokenizer = hf
    url = apps["perturbed"]
    prompts = [PROMPT, "import os\n"]
    both = complete(url, prompt=prompts, n=2, max_tokens=6)
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    alone = [only(complete(url, prompt=p, max_tokens=6))["token_ids"] for p in prompts]
    assert [c["token_ids"] for c in both["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert both["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    as_ids = complete(url, prompt=[tokenizer.encode(p) for p in prompts], max_tokens=6)
    assert [c["token_ids"] for c in as_ids["choices"]] == alone


def test_several_choices_stream_under_their_index(apps):
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 3}
    chunks = stream_chunks(apps["perturbed"], C, body)
    texts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    whole = post(apps["perturbed"], C, **body)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_continuous_usage_stats_count_as_the_stream_goes(apps):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream_chunks(apps["perturbed"], CHAT, body)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and len(chunks) > 3
    assert all("usage" in chunk for chunk in chunks)


@pytest.mark.parametrize("path", [C, CHAT], ids=["completions", "chat"])
def test_the_bodies_guidellm_sends_get_every_token(apps, path):
    """GuideLLM 0.8.1's request bodies (docs/../FACTS: ignore_eos, stop null, continuous usage)."""
    body = {"max_tokens": 64, "ignore_eos": True, "stop": None,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body |= {"prompt": PROMPT} if path == C else {"messages": [{"role": "user", "content": PROMPT}]}
    chunks = stream_chunks(apps["perturbed"], path, body)
    assert chunks[-1]["usage"]["completion_tokens"] == 64
