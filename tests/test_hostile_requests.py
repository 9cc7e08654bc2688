"""No request harms another (issue 9), through HTTP on a real local Ray: poison sampling
values, a model that computes NaN for one request, oversized bodies, wrong content types,
missing API keys and overdue requests each get a clear answer in the OpenAI format, while
greedy streams running beside them complete token-identical to the target alone."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import torch
from ray import serve

from replicas.engines.huggingface.loading import load_causal_lm

from replicas.tokenizer import load_tokenizer
from training.tiny_models import UNTRAINED_NOTE, save
from cluster.config import ModelSpec
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import stream_chunks, stream_complete
from tests.test_cache_release import wait_for_empty_caches

MODEL = "specserve"
NEIGHBOUR_TOKENS = 48
TIMEOUT = 120

# Values that reached `multinomial` as NaN or inf before, and failed every sequence batched
# or gathered with them (issue 9): each must now get a 200 or a 4xx.
POISONS = {
    "temperature-1e-300": {"temperature": 1e-300},
    "temperature-denormal": {"temperature": 5e-324},
    "temperature-float32-underflow": {"temperature": 1e-45},
    "temperature-at-epsilon": {"temperature": 1e-5, "top_k": 1},
    "top_p-1e-300": {"temperature": 1.0, "top_p": 1e-300},
    "top_p-denormal-top_k": {"temperature": 0.7, "top_p": 5e-324, "top_k": 3},
    "seed-huge": {"temperature": 1.0, "seed": 2 ** 200},
    "seed-negative": {"temperature": 1.0, "seed": -2 ** 70},
}


@contextmanager
def neighbours(url: str, prompts: list[str], max_tokens: int = NEIGHBOUR_TOKENS, **fields):
    """Greedy streams running in the background; yields a callable that waits for their
    results (reassembled responses) and a callable that says whether any is still running."""
    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(stream_complete, url, p, max_tokens=max_tokens, speculation={"k": 4}, **fields)
               for p in prompts]
    try:
        yield (lambda: [f.result(timeout=TIMEOUT) for f in futures]), (lambda: not all(f.done() for f in futures))
    finally:
        pool.shutdown(wait=True)


def assert_exact(results: list[dict], prompts: list[str], greedy_reference, max_tokens: int = NEIGHBOUR_TOKENS):
    for prompt, result in zip(prompts, results):
        assert result["choices"][0]["token_ids"] == greedy_reference(prompt, max_tokens), prompt


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert code is None or error["code"] == code, error
    return error


def post(url: str, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT, **kwargs)


# ---------------------------------------------------------------- poison sampling values

def test_poison_sampling_values_harm_no_neighbour(apps, greedy_reference):
    url, prompts = apps["perturbed"], PROMPTS[:4]
    answers: dict[str, set[int]] = {name: set() for name in POISONS}
    with neighbours(url, prompts) as (results, running):
        while True:   # every poison at least once, and again while the streams run
            for name, fields in POISONS.items():
                for speculation in ({"k": 4}, {"enabled": False}):
                    response = post(url, {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": 8,
                                          "speculation": speculation, **fields})
                    answers[name].add(response.status_code)
                    assert response.status_code == 200 or 400 <= response.status_code < 500, (name, response.text)
            if not running():
                break
        assert_exact(results(), prompts, greedy_reference)
    assert all(codes == {200} for codes in answers.values()), answers


@pytest.fixture(scope="module")
def nan_target(zoo, greedy_reference, tmp_path_factory):
    """The test target with one token's embedding set to NaN: a sequence holding that token
    gets NaN logits, every other sequence exactly the clean target's. The token is one that
    neither the neighbours' prompts nor their greedy outputs contain."""
    tokenizer = load_tokenizer(zoo.target)
    used = {t for p in PROMPTS[:4] for t in tokenizer.encode(p) + greedy_reference(p, NEIGHBOUR_TOKENS)}
    poison = next(t for t in range(3, len(tokenizer)) if t not in used)
    model = load_causal_lm(ModelSpec(path=zoo.target))
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    return save(model, tokenizer, tmp_path_factory.mktemp("nan") / "target", UNTRAINED_NOTE), poison


def test_a_request_the_model_computes_nan_for_fails_alone(ray_serve, zoo, nan_target, greedy_reference):
    path, poison = nan_target
    url = deploy(ray_serve, "nan-target", cluster_config(path, zoo.drafts["perturbed"]))
    prompts = PROMPTS[:4]
    try:
        with neighbours(url, prompts) as (results, running):
            failures = 0
            while running() or failures == 0:
                response = post(url, {"model": MODEL, "prompt": [5, poison, 9], "max_tokens": 8, "temperature": 0})
                error = assert_openai_error(response, 500, "internal_error")
                assert "NonFiniteDistribution" in error["message"] and error["type"] == "server_error"
                failures += 1
            assert_exact(results(), prompts, greedy_reference)
        assert wait_for_empty_caches("nan-target") == {"draft": 0, "target": 0}
    finally:
        serve.delete("nan-target")


# ---------------------------------------------------------------- bodies and content types

def test_a_50_mb_body_gets_413_without_stalling_the_streams(apps, greedy_reference):
    url, prompts = apps["perturbed"], PROMPTS[:4]
    huge = json.dumps({"model": MODEL, "prompt": "x" * (50 * 2 ** 20)}).encode()
    with neighbours(url, prompts) as (results, _):
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", content=huge,
                              headers={"content-type": "application/json"}, timeout=TIMEOUT)
        refused_after = time.monotonic() - started
        assert_openai_error(response, 413, "request_too_large")
        assert_exact(results(), prompts, greedy_reference)
    assert refused_after < 30, refused_after   # not read, parsed nor tokenised


def test_a_chunked_body_over_the_limit_gets_413(apps):
    def chunks():   # no Content-Length: the limit is found while reading
        yield b'{"model": "specserve", "prompt": "'
        for _ in range(24):
            yield b"y" * 2 ** 16
        yield b'"}'

    response = httpx.post(f"{apps['copy']}/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert_openai_error(response, 413, "request_too_large")
    assert post(apps["copy"], {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_only_json_bodies_start_work(apps, path, content_type):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{apps['copy']}{path}", content=body, headers=headers, timeout=TIMEOUT)
    assert_openai_error(response, 415, "unsupported_media_type")
    charset = httpx.post(f"{apps['copy']}/v1/completions", content=body, timeout=TIMEOUT,
                         headers={"content-type": "application/json; charset=utf-8"})
    assert charset.status_code == 200, charset.text


# ---------------------------------------------------------------- API keys

@pytest.fixture(scope="module")
def keyed_app(ray_serve, zoo, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys"
    keys_file.write_text("# operators\nsk-first-key\n\n  sk-second-key  # rotated in 2026\n")
    config = cluster_config(zoo.target, zoo.drafts["copy"], server={"api_keys_file": str(keys_file)})
    yield deploy(ray_serve, "keyed", config)
    serve.delete("keyed")


@pytest.mark.parametrize("authorization", [None, "Bearer", "Bearer sk-wrong", "Bearer sk-first-ke",
                                           "Basic sk-first-key", "sk-first-key", "Bearer sk-first-key2"])
def test_a_request_without_a_valid_key_gets_401(keyed_app, authorization):
    headers = {"authorization": authorization} if authorization is not None else {}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    error = assert_openai_error(post(keyed_app, body, headers=headers), 401, "invalid_api_key")
    assert error["type"] == "invalid_request_error"
    models = httpx.get(f"{keyed_app}/v1/models", headers=headers, timeout=TIMEOUT)
    assert_openai_error(models, 401, "invalid_api_key")
    assert models.headers["www-authenticate"] == "Bearer"


def test_every_listed_key_opens_the_api_and_health_stays_open(keyed_app):
    for key in ("sk-first-key", "sk-second-key"):
        response = post(keyed_app, {"model": MODEL, "prompt": "x", "max_tokens": 2},
                        headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
    assert httpx.get(f"{keyed_app}/health", timeout=TIMEOUT).status_code == 200


# ---------------------------------------------------------------- deadlines

@pytest.fixture(scope="module")
def hurried_app(ray_serve, zoo):
    config = cluster_config(zoo.target, zoo.drafts["unrelated"], limits={"request_timeout_s": 0.5})
    yield deploy(ray_serve, "hurried", config)
    serve.delete("hurried")


def longest_prompt(greedy_reference, max_tokens: int) -> str:
    return max(PROMPTS, key=lambda p: len(greedy_reference(p, max_tokens)))


def test_an_overdue_request_gets_504_and_frees_its_caches(hurried_app, greedy_reference):
    # about one token per round with the unrelated draft: 240 tokens take several seconds
    prompt = longest_prompt(greedy_reference, 240)
    assert len(greedy_reference(prompt, 240)) > 200
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 240, "temperature": 0, "speculation": {"k": 1}}
    error = assert_openai_error(post(hurried_app, body), 504, "timeout")
    assert "0.5 s" in error["message"]
    assert wait_for_empty_caches("hurried") == {"draft": 0, "target": 0}


def test_an_overdue_stream_ends_with_an_error_event(hurried_app, greedy_reference):
    prompt = longest_prompt(greedy_reference, 240)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 240, "temperature": 0, "stream": True,
            "return_token_ids": True, "speculation": {"k": 1}}
    events = []
    with httpx.stream("POST", f"{hurried_app}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "timeout" and last["error"]["type"] == "server_error"
    received = [t for e in events[:-2] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert received == greedy_reference(prompt, 240)[:len(received)]   # what came was right
    assert len(received) < 240
    assert wait_for_empty_caches("hurried") == {"draft": 0, "target": 0}
