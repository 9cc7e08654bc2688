"""Concurrent requests through a real local Ray: batched verification and drafting keep greedy
output identical to target-only decoding, a KV budget smaller than the load evicts and
rebuilds without a wrong token, and a request survives the death of the replica holding its
cache."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from replicas.tokenizer import load_tokenizer
from router.routing import lane_count, lane_of
from tests.conftest import MAX_TOKENS, PROMPTS, cluster_config, deploy
from tests.test_cache_release import wait_for_empty_caches
from tests.http_client import complete, reassemble, stream_chunks

def run_concurrently(url: str, prompts: list[str], **fields) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p, **fields), prompts))


def test_eight_concurrent_streams_are_batched_and_exact(apps, greedy_reference):
    results = run_concurrently(apps["perturbed"], PROMPTS, max_tokens=MAX_TOKENS, speculation={"k": 4})
    for prompt, result in zip(PROMPTS, results):
        assert result["choices"][0]["token_ids"] == greedy_reference(prompt, MAX_TOKENS)
    stats = [r["speculation"] for r in results]
    mean_verify_batch = sum(s["mean_verify_batch"] for s in stats) / len(stats)
    mean_draft_batch = sum(s["mean_draft_batch"] for s in stats) / len(stats)
    # One stream alone would be 1.0. The target gathers every active stream (5.8 here when
    # written); the issue asks for a mean verify batch of at least 4 at 8 streams.
    assert mean_verify_batch >= 4 and mean_draft_batch > 1.5, stats
    assert all(s["coordination_ms_per_round"] >= 0 for s in stats)


def test_kv_budget_of_two_sequences_evicts_and_rebuilds(ray_serve, zoo, greedy_reference):
    tokenizer = load_tokenizer(zoo.target)
    longest = max(len(tokenizer.encode(p)) for p in PROMPTS[:6]) + MAX_TOKENS + 8
    budget = {"kv_cache": {"max_tokens": 2 * longest}, "resources": {"num_cpus": 0.1}}
    config = cluster_config(zoo.target, zoo.drafts["perturbed"],
                            pools={"router": {"resources": {"num_cpus": 0.1}}, "draft": budget, "target": budget})
    url = deploy(ray_serve, "kv-budget", config)
    try:
        results = run_concurrently(url, PROMPTS[:6], max_tokens=MAX_TOKENS, speculation={"k": 4})
        for prompt, result in zip(PROMPTS[:6], results):
            assert result["choices"][0]["token_ids"] == greedy_reference(prompt, MAX_TOKENS)
        for pool in ("draft", "target"):
            state = serve.get_deployment_handle(pool, app_name="kv-budget").describe.remote().result()
            assert state["evictions"] > 0, (pool, state)
            assert state["cached_tokens"] <= 2 * longest
    finally:
        serve.delete("kv-budget")


def test_request_survives_killing_the_replica_that_holds_its_cache(ray_serve, zoo, greedy_reference):
    config = cluster_config(zoo.target, zoo.drafts["unrelated"],  # about one token per round: many rounds
                            pools={"target": {"replicas": 2, "resources": {"num_cpus": 0.1}}})
    url = deploy(ray_serve, "failover", config)
    target = serve.get_deployment_handle("target", app_name="failover")
    max_tokens = 240
    prompt = max(PROMPTS, key=lambda p: len(greedy_reference(p, max_tokens)))  # the most rounds
    try:
        chunks = stream_chunks(url, prompt, max_tokens=max_tokens, speculation={"k": 2})
        first = next(chunks)
        seq_id = first["id"]
        lane = lane_of(seq_id, lane_count(config.pools))   # the session id its calls carry
        # Asked of every replica, not only the one this driver's handle routes the lane to: its
        # view of the replicas may differ from the router's for a moment (seen once in 6 runs).
        # Asked again while none answers: during a forward pass the batch's sequences are out of
        # the cache's index until it commits (replicas/engines/huggingface/kv_cache.py), and this one's target is
        # in one most of the time (seen once in 3 full runs).
        holders: list[dict] = []
        for _ in range(30):
            holders = [state for state in _every_replica(target, seq_id) if state["holds"]]
            if holders:
                break
            time.sleep(0.05)
        assert len(holders) == 1, holders
        [holder] = holders
        os.kill(holder["pid"], signal.SIGKILL)
        received_before_kill = len(first["choices"][0]["token_ids"]) if first["choices"] else 0
        result = reassemble([first, *chunks])
        assert received_before_kill < max_tokens
        assert result["choices"][0]["token_ids"] == greedy_reference(prompt, max_tokens)
        after = target.options(session_id=lane).describe.remote().result()
        assert after["pid"] != holder["pid"]
    finally:
        serve.delete("failover")


def _every_replica(handle, seq_id: str, calls: int = 24) -> list[dict]:
    """describe(seq_id) of each replica the handle reaches under `calls` session ids, by pid."""
    found = {}
    for state in [handle.options(session_id=f"probe-{i}").describe.remote(seq_id) for i in range(calls)]:
        state = state.result()
        found[state["pid"]] = state
    return list(found.values())


def test_a_client_that_disconnects_mid_stream_does_not_hold_up_the_others(apps, greedy_reference):
    # The streams share gathered calls (router/gathering.py): the one that goes away must
    # neither stall nor cut short the others, and its caches are freed.
    url, max_tokens = apps["perturbed"], 48
    prompts = PROMPTS[:4]

    # the longest generation, so that the client surely leaves in the middle of it
    leaving_prompt = max(PROMPTS[4:], key=lambda p: len(greedy_reference(p, 240)))

    def leave_after_first_chunk() -> None:
        chunks = stream_chunks(url, leaving_prompt, max_tokens=240, speculation={"k": 4})
        next(chunks)
        chunks.close()   # closes the HTTP stream with the generation still running

    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        leaving = pool.submit(leave_after_first_chunk)
        streams = [pool.submit(lambda p: reassemble(stream_chunks(url, p, max_tokens=max_tokens,
                                                                  speculation={"k": 4})), p) for p in prompts]
        leaving.result(timeout=120)
        results = [stream.result(timeout=120) for stream in streams]
    for prompt, result in zip(prompts, results):
        assert result["choices"][0]["token_ids"] == greedy_reference(prompt, max_tokens)
    assert wait_for_empty_caches("spec-perturbed") == {"draft": 0, "target": 0}
    assert complete(url, PROMPTS[5], max_tokens=8)["choices"][0]["token_ids"] == greedy_reference(PROMPTS[5], 8)
