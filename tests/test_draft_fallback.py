"""When the draft pool cannot serve, sequences go on with prompt-lookup drafts
(speculation.lookup_fallback) or the target alone: greedy output stays token-identical,
clients see no error, the response counts the fallback rounds and the lookup drafts that
carried on, and speculation from the draft pool resumes once a draft replica answers again."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from ray import serve

from cluster.app import build_app
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import complete, reassemble, stream_chunks

STREAM_TOKENS = 200


def long_prompts(greedy_reference, count: int) -> list[str]:
    """Prompts whose greedy output runs the whole STREAM_TOKENS (no early EOS): many rounds."""
    prompts = sorted(PROMPTS, key=lambda p: -len(greedy_reference(p, STREAM_TOKENS)))[:count]
    assert all(len(greedy_reference(p, STREAM_TOKENS)) == STREAM_TOKENS for p in prompts)
    return prompts


def fallback_config(zoo, **draft):
    pools = {"draft": {"resources": {"num_cpus": 0.1}, "call_timeout_ms": 500.0, **draft}}
    return cluster_config(zoo.target, zoo.drafts["perturbed"], pools=pools)


def test_killing_every_draft_replica_mid_run_falls_back_and_recovers(ray_serve, zoo, greedy_reference):
    url = deploy(ray_serve, "draft-loss", fallback_config(zoo))
    draft = serve.get_deployment_handle("draft", app_name="draft-loss")
    prompts = long_prompts(greedy_reference, 4)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            # half the streams hybrid: lookup drafts where they match, the (killed) pool's elsewhere
            methods = ["draft_model", "hybrid"] * (len(prompts) // 2)
            streams = [stream_chunks(url, p, max_tokens=STREAM_TOKENS, speculation={"k": 4, "method": method})
                       for p, method in zip(prompts, methods)]
            firsts = list(pool.map(next, streams))          # every stream is under way
            os.kill(draft.describe.remote().result()["pid"], signal.SIGKILL)
            # new requests while the pool is down
            during = complete(url, PROMPTS[1], max_tokens=24, speculation={"k": 4})
            results = list(pool.map(lambda pair: reassemble([pair[0], *pair[1]]), zip(firsts, streams)))
        for prompt, method, result in zip(prompts, methods, results):
            assert result["choices"][0]["token_ids"] == greedy_reference(prompt, STREAM_TOKENS)
            assert result["choices"][0]["finish_reason"] == "length"
            if method == "draft_model":
                assert result["speculation"]["fallback_rounds"] > 0, result["speculation"]
        assert during["choices"][0]["token_ids"] == greedy_reference(PROMPTS[1], 24)
        assert during["speculation"]["fallback_rounds"] > 0
        # lookup drafts carried the rounds on while the pool was down
        assert sum(r["speculation"]["by_kind"]["ngram"]["rounds"] for r in results) > 0

        resumed = wait_for_speculation(url, PROMPTS[2], greedy_reference, timeout_s=90)
        assert resumed["speculation"]["fallback_rounds"] == 0
        assert resumed["speculation"]["by_kind"]["draft_model"]["drafted_tokens"] > 0
    finally:
        serve.delete("draft-loss")


def wait_for_speculation(url: str, prompt: str, greedy_reference, timeout_s: float) -> dict:
    """Greedy requests until one speculated in every round; each must be exact meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = complete(url, prompt, max_tokens=24, speculation={"k": 4})
        assert out["choices"][0]["token_ids"] == greedy_reference(prompt, 24)
        if out["speculation"]["fallback_rounds"] == 0 or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def test_a_draft_pool_that_cannot_be_placed_serves_the_target_alone(ray_serve, zoo, greedy_reference):
    # no node has this resource: the draft replica stays pending forever
    config = fallback_config(zoo, resources={"num_cpus": 0.1, "custom": {"no_such_node_kind": 1}})
    serve._run(build_app(config), name="no-drafts", route_prefix="/no-drafts", _blocking=False)
    url = f"{ray_serve}/no-drafts"
    try:
        wait_until_healthy("no-drafts", ("router", "target"), timeout_s=120)
        assert serve.status().applications["no-drafts"].deployments["draft"].status.value != "HEALTHY"
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: complete(url, p, max_tokens=32, speculation={"k": 4}), PROMPTS[:4]))
        for prompt, result in zip(PROMPTS[:4], results):
            assert result["choices"][0]["token_ids"] == greedy_reference(prompt, 32)
            spec = result["speculation"]
            # every round wanted drafts but, where one token was left, the last; a round without
            # drafts runs several target steps (pools.target.decode_steps)
            assert 1 < spec["rounds"] < len(result["choices"][0]["token_ids"])
            assert spec["by_kind"]["draft_model"]["drafted_tokens"] == 0, spec
            assert spec["rounds"] - 1 <= spec["fallback_rounds"] <= spec["rounds"], spec
    finally:
        serve.delete("no-drafts")


def wait_until_healthy(app: str, deployments: tuple[str, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status and all(name in status.deployments and status.deployments[name].status.value == "HEALTHY"
                          for name in deployments):
            return
        time.sleep(0.5)
    raise AssertionError(f"{deployments} of {app} not healthy within {timeout_s} s: {serve.status()}")


def test_drafts_later_than_their_budget_are_not_waited_for(ray_serve, zoo, greedy_reference):
    # a budget no propose call can meet (nor the probe): every round goes on without drafts
    url = deploy(ray_serve, "late-drafts", fallback_config(zoo, call_timeout_ms=0.01))
    try:
        for prompt in PROMPTS[:2]:
            result = complete(url, prompt, max_tokens=16, speculation={"k": 4})
            assert result["choices"][0]["token_ids"] == greedy_reference(prompt, 16)
            spec = result["speculation"]
            assert spec["by_kind"]["draft_model"]["drafted_tokens"] == 0, spec
            assert spec["rounds"] - 1 <= spec["fallback_rounds"] <= spec["rounds"] and spec["fallback_rounds"] > 0
    finally:
        serve.delete("late-drafts")


def test_a_target_pool_that_does_not_answer_in_time_gives_504(ray_serve, zoo):
    config = cluster_config(zoo.target, zoo.drafts["copy"],
                            pools={"target": {"resources": {"num_cpus": 0.1}, "call_timeout_s": 0.001}})
    url = deploy(ray_serve, "late-target", config)
    try:
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "specserve", "prompt": "import os\n", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["code"] == "timeout" and "target pool" in error["message"]
    finally:
        serve.delete("late-target")
