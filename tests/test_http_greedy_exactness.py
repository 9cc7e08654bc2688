"""Greedy speculation through HTTP equals target-only greedy decoding, token for token, for
every k and draft regime, streaming or not, up to max_tokens and stop-string boundaries."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer
from tests.http_client import complete, stream_complete

PROMPTS = [
    "x",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n        self.pos = 0\n\n    def peek(self):\n",
]
MAX_TOKENS = 24
KS = (1, 3, 5)


@pytest.fixture(scope="module")
def reference(apps, zoo) -> dict[str, dict]:
    """Target-only greedy completions: the server with speculation off, checked against
    Hugging Face's own greedy generate() on the same weights."""
    model = load_causal_lm(ModelSpec(path=zoo.target))
    tokenizer = load_tokenizer(zoo.target)
    out = {}
    for prompt in PROMPTS:
        served = complete(apps["copy"], prompt, max_tokens=MAX_TOKENS, speculation={"enabled": False})
        ids = tokenizer.encode(prompt)
        hf = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=tokenizer.eos_token_id)
        expected = hf[0, len(ids):].tolist()
        got = served["choices"][0]["token_ids"]
        assert got == expected[:len(got)], "speculation-off path differs from HF greedy decoding"
        assert served["speculation"]["drafted_tokens"] == 0
        out[prompt] = served["choices"][0]
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("regime", ["copy", "unrelated", "perturbed"])
def test_speculative_greedy_equals_target_only(apps, reference, regime, k, stream):
    call = stream_complete if stream else complete
    for prompt in PROMPTS:
        got = call(apps[regime], prompt, max_tokens=MAX_TOKENS, speculation={"k": k})
        want = reference[prompt]
        assert got["choices"][0]["token_ids"] == want["token_ids"]
        assert got["choices"][0]["text"] == want["text"]
        assert got["choices"][0]["finish_reason"] == want["finish_reason"]
        assert got["usage"]["completion_tokens"] == len(want["token_ids"])
        assert got["speculation"]["drafted_tokens"] > 0


def test_the_test_clusters_run_the_fused_cpu_forward(apps):
    """What every exactness test here runs through: float32 on a CPU, the default
    models.*.compile: auto, the fused CPU forward (replicas/engines/huggingface/fused_cpu.py)."""
    from ray import serve

    for deployment in ("target", "draft"):
        state = serve.get_deployment_handle(deployment, app_name="spec-copy").describe.remote().result()
        assert state["fused_cpu"] is True and state["dtype"] == "float32", state


def test_acceptance_reflects_the_draft(apps):
    rates = {}
    for regime in ("copy", "unrelated", "perturbed"):
        stats = complete(apps[regime], PROMPTS[2], max_tokens=48, speculation={"k": 4})["speculation"]
        rates[regime] = stats["acceptance_rate"]
    assert rates["copy"] >= 0.95
    assert rates["unrelated"] <= 0.2
    assert rates["unrelated"] < rates["perturbed"] < rates["copy"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("max_tokens", [1, 2, 4, 5, 6, 11])
def test_max_tokens_boundaries(apps, reference, max_tokens, stream):
    """Rounds yield up to k + 1 tokens; the output still stops exactly at max_tokens."""
    call = stream_complete if stream else complete
    prompt = PROMPTS[1]
    want = reference[prompt]["token_ids"][:max_tokens]
    for regime in ("copy", "perturbed"):
        got = call(apps[regime], prompt, max_tokens=max_tokens, speculation={"k": 4})
        assert got["choices"][0]["token_ids"] == want
        assert got["choices"][0]["finish_reason"] == "length"
        assert got["usage"]["completion_tokens"] == max_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_boundaries(apps, reference, stream):
    """A stop string ends the text just before it, whichever round it falls in, whatever made
    the round's drafts."""
    call = stream_complete if stream else complete
    prompt = PROMPTS[2]
    full_text = reference[prompt]["text"]
    for start in (1, 5, len(full_text) // 2):
        stop = full_text[start:start + 3]
        cut = full_text.index(stop)
        want_text = full_text[:cut]
        # the draft pool's drafts in three regimes, and the drafts made without it
        cases = [(regime, {"k": k}) for regime in ("copy", "perturbed", "unrelated") for k in (1, 4)]
        cases += [("perturbed", {"k": k, "method": method}) for method in ("ngram", "suffix", "hybrid") for k in (1, 8)]
        for regime, speculation in cases:
            got = call(apps[regime], prompt, max_tokens=MAX_TOKENS, stop=[stop, "never-seen"],
                       speculation=speculation)["choices"][0]
            assert got["text"] == want_text, (regime, speculation, stop)
            assert got["finish_reason"] == "stop"
            assert got["token_ids"] == reference[prompt]["token_ids"][:len(got["token_ids"])]


# Penalties and biases change the target's distribution at every position of a window, drafts
# included: the reference decodes one token at a time with Hugging Face forward passes, the
# repetition penalty by transformers' own processor and the rest by their vLLM definitions
# (tests/test_logits_processing.py), never through the engine's code.
ADJUSTED = {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.4}


@pytest.fixture(scope="module")
def adjusted_reference(zoo) -> dict[str, list[int]]:
    from replicas.sampling import SamplingParams
    from tests.test_logits_processing import reference_row

    model = load_causal_lm(ModelSpec(path=zoo.target))
    tokenizer = load_tokenizer(zoo.target)
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        # a bias against the target's own first choice, and for another token
        with torch.inference_mode():
            first = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        bias = ((first, -4.0), ((first + 1) % len(tokenizer), 2.0))
        params = SamplingParams(temperature=0.0, logit_bias=bias, **ADJUSTED)
        tokens = list(ids)
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(reference_row(logits, params, tokens, len(ids)).argmax()))
        out[prompt] = {"tokens": tokens[len(ids):], "logit_bias": {str(t): b for t, b in bias}}
    return out


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("regime", ["copy", "unrelated", "perturbed"])
def test_greedy_with_penalties_and_bias_equals_the_target_alone(apps, reference, adjusted_reference, regime, k):
    for prompt in PROMPTS:
        want = adjusted_reference[prompt]
        assert want["tokens"] != reference[prompt]["token_ids"]      # the adjustments change the output
        fields = {**ADJUSTED, "logit_bias": want["logit_bias"], "max_tokens": MAX_TOKENS}
        got = complete(apps[regime], prompt, speculation={"k": k}, **fields)["choices"][0]["token_ids"]
        assert got == want["tokens"][:len(got)]
        assert len(got) == MAX_TOKENS or got[-1] == 0                # or it ended on EOS (id 0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_target_alone_stops_exactly_where_asked(apps, reference, stream):
    """Its rounds run several steps per target call (pools.target.decode_steps): the output
    still ends exactly at max_tokens, and at a stop string inside one call's tokens."""
    call = stream_complete if stream else complete
    prompt = PROMPTS[1]
    want = reference[prompt]
    alone = {"enabled": False}
    whole = call(apps["copy"], prompt, max_tokens=MAX_TOKENS, speculation=alone)
    assert whole["choices"][0]["token_ids"] == want["token_ids"]
    assert whole["speculation"]["rounds"] < whole["usage"]["completion_tokens"]   # calls of several steps
    for max_tokens in (1, 2, 3, 5, 6, 9):
        got = call(apps["copy"], prompt, max_tokens=max_tokens, speculation=alone)
        assert got["choices"][0]["token_ids"] == want["token_ids"][:max_tokens]
        assert got["choices"][0]["finish_reason"] == "length"
    text = want["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    got = call(apps["copy"], prompt, max_tokens=MAX_TOKENS, stop=[stop], speculation=alone)
    assert got["choices"][0]["text"] == text[:text.index(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"


LOOKUP_CASES = [(method, k) for method in ("ngram", "suffix", "hybrid") for k in range(1, 9)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("method, k", LOOKUP_CASES)
def test_prompt_lookup_greedy_equals_target_only(apps, reference, method, k, stream):
    """`speculation.method: ngram`: drafts copied from the sequence in the router (replicas/drafting/lookup.py);
    `suffix`: from the sequence or the router's recent outputs (replicas/drafting/suffix.py; these prompts
    were answered before, so its drafts are often whole outputs); `hybrid`: lookup where a
    suffix of 2 or more tokens matched, the draft pool's in other rounds."""
    call = stream_complete if stream else complete
    drafted = {"ngram": 0, "suffix": 0, "draft_model": 0, "forced": 0}
    lookup = "suffix" if method == "suffix" else "ngram"
    for prompt in PROMPTS:
        got = call(apps["perturbed"], prompt, max_tokens=MAX_TOKENS, speculation={"method": method, "k": k})
        want = reference[prompt]
        assert got["choices"][0]["token_ids"] == want["token_ids"]
        assert got["choices"][0]["text"] == want["text"]
        assert got["choices"][0]["finish_reason"] == want["finish_reason"]
        for kind, counts in got["speculation"]["by_kind"].items():
            drafted[kind] += counts["drafted_tokens"]
    assert drafted[lookup] > 0 and drafted["forced"] == 0    # no grammar, nothing forced
    if method == "hybrid":
        assert drafted["draft_model"] > 0
    else:
        assert drafted["draft_model"] == 0 and drafted["ngram" if method == "suffix" else "suffix"] == 0


def test_hybrid_requests_without_a_k_follow_the_controllers_choice(apps, reference):
    """A hybrid request that fixes no k gets k, and whether lookup or the draft pool drafts
    each round, from the router's goodput controller (router/k_control.py): exact whatever
    it chooses, and its rounds counted under hybrid."""
    from ray import serve

    def hybrid_rounds() -> int:
        state = router.describe.remote().result()["adaptive"]
        return sum(state["k_by_method"].get("hybrid", {}).values())

    router = serve.get_deployment_handle("router", app_name="spec-perturbed")
    rounds = 0
    for prompt in PROMPTS:
        got = complete(apps["perturbed"], prompt, max_tokens=MAX_TOKENS, speculation={"method": "hybrid"})
        assert got["choices"][0]["token_ids"] == reference[prompt]["token_ids"]
        rounds += got["speculation"]["rounds"]
    assert hybrid_rounds() >= min(rounds, 256)     # the controller keeps the last 256 rounds' choices


def test_suffix_drafts_copy_an_earlier_requests_output(apps, zoo):
    """The target alone's answer goes into the router's output cache: asked again, the suffix
    drafts are that answer, every one kept (greedy), in fewer rounds than prompt lookup in
    the sequence alone takes."""
    tokenizer = load_tokenizer(zoo.target)
    ids = tokenizer.encode("suffix drafting, a prompt of its own: ") + [7, 300, 41, 209]
    alone = complete(apps["unrelated"], ids, max_tokens=24, speculation={"enabled": False})
    suffix = complete(apps["unrelated"], ids, max_tokens=24, speculation={"method": "suffix", "k": 8})
    ngram = complete(apps["unrelated"], ids, max_tokens=24, speculation={"method": "ngram", "k": 8})
    for got in (suffix, ngram):
        assert got["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    kinds = suffix["speculation"]["by_kind"]["suffix"]
    assert kinds["accepted_tokens"] == kinds["drafted_tokens"] >= 16
    assert suffix["speculation"]["rounds"] <= 3 < ngram["speculation"]["rounds"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_prompt_lookup_stops_at_stop_strings_and_max_tokens(apps, reference, stream, method):
    call = stream_complete if stream else complete
    prompt = PROMPTS[1]
    want = reference[prompt]
    lookup = {"method": method, "k": 6}
    for max_tokens in (1, 2, 5, 9):
        got = call(apps["copy"], prompt, max_tokens=max_tokens, speculation=lookup)
        assert got["choices"][0]["token_ids"] == want["token_ids"][:max_tokens]
    text = want["text"]
    for stop in (text[len(text) // 2:len(text) // 2 + 2], text[-3:]):
        got = call(apps["copy"], prompt, max_tokens=MAX_TOKENS, stop=[stop], speculation=lookup)
        assert got["choices"][0]["text"] == text[:text.index(stop)]
        assert got["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("method", ["ngram", "hybrid"])
def test_lookup_drafts_stay_within_the_context(apps, zoo, method):
    """A repeating prompt a few tokens short of the context (512): every lookup finds a long
    match, and its drafts must still leave the last position free."""
    tokenizer = load_tokenizer(zoo.target)
    line = tokenizer.encode("x = 1\n")
    ids = (line * (512 // len(line) + 1))[:509]
    alone = complete(apps["copy"], ids, max_tokens=16, speculation={"enabled": False})
    got = complete(apps["copy"], ids, max_tokens=16, speculation={"method": method, "k": 8})
    assert got["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert got["usage"]["completion_tokens"] == 3          # the context's room
