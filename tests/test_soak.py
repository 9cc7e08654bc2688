"""The chaos soak (cluster/bench/soak.py) against a live app: draft and target replicas
SIGKILLed while clients send greedy and seeded sampled requests, streamed and not, and every
answer is the target alone's; and the soak does catch an answer that is not."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from cluster.bench import soak
from tests.conftest import cluster_config, deploy

MAX_TOKENS = 24


async def references(url: str) -> dict:
    async with httpx.AsyncClient(timeout=120) as http:
        return await soak.references_of(http, url, "specserve", MAX_TOKENS)


@pytest.fixture(scope="module")
def soak_app(ray_serve, zoo):
    pools = {"draft": {"replicas": 2, "resources": {"num_cpus": 0.1}},
             "target": {"replicas": 2, "resources": {"num_cpus": 0.1}}}
    yield deploy(ray_serve, "soak", cluster_config(zoo.target, zoo.drafts["perturbed"], pools=pools))
    serve.delete("soak")


def test_every_combination_of_request_is_sent():
    sent = {soak.request_mix(client, turn) for client in range(3) for turn in range(24)}
    assert {(r.seed, r.stream, r.method) for r in sent} == {
        (seed, stream, method) for seed in soak.SEEDS for stream in (False, True) for method in soak.METHODS}


def test_a_soak_with_replicas_killed_loses_and_changes_no_answer(soak_app, greedy_reference):
    report = asyncio.run(soak.soak(soak_app, "soak", "specserve", clients=3, seconds=24, kill_every_s=6,
                                   max_tokens=MAX_TOKENS, seed=0))
    assert report["kills"] >= 3 and {k["pool"] for k in report["kill_log"]} == {"draft", "target"}, report
    assert report["failed"] == 0 and report["inexact"] == 0, report
    assert report["exact"] == report["requests"] >= 6


def test_the_soak_reports_an_answer_unlike_its_reference(soak_app, greedy_reference, monkeypatch):
    """The references the soak compares with are the target alone's: greedy ones are HF
    generate()'s; one made wrong on purpose makes every answer to it inexact."""
    taken = asyncio.run(references(soak_app))
    for (prompt, seed), (tokens, _) in taken.items():
        if seed is None:
            assert tokens == greedy_reference(prompt, MAX_TOKENS)
    wrong = {key: (tokens[:-1] + [(tokens[-1] + 1) % 100], finish) for key, (tokens, finish) in taken.items()}

    async def wrong_references(*_):
        return wrong

    monkeypatch.setattr(soak, "references_of", wrong_references)
    report = asyncio.run(soak.soak(soak_app, "soak", "specserve", clients=2, seconds=3, kill_every_s=600,
                                   max_tokens=MAX_TOKENS, seed=0))
    assert report["kills"] == 0 and report["failed"] == 0
    assert report["inexact"] == report["requests"] >= 2
