"""A tensor-parallel target (tp_size 2) computes what one process computes: the sharded
logits agree with the unsharded ones within TOLERANCE on ragged batches, the KV cache holds
each shard's own heads and evicts as one process would, greedy output over HTTP equals the
target alone token for token with speculation on and off, and a shard killed mid-stream
costs a replica restart, never a wrong or lost token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ray import serve

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from replicas.engines.huggingface.shard_group import ShardGroupBroken, launch_local
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import complete, reassemble, stream_chunks, wait_for_the_draft_pool

# float32 sums taken in another order (two partial sums, then the all-reduce): measured
# differences are about 5e-6 on these logits, whose magnitude is about 1.
TOLERANCE = 1e-4
BUDGET = 64    # cached positions per runner: small, so that the steps below evict


@pytest.fixture(scope="module")
def runners(zoo):
    """The zoo's target as 2 shards (this process is rank 0) and as one process."""
    sharded = launch_local(ModelSpec(path=zoo.target), max_cached_tokens=BUDGET, world=2)
    yield sharded, ModelRunner(load_causal_lm(ModelSpec(path=zoo.target)), max_cached_tokens=BUDGET)
    sharded.close()


def test_sharded_logits_equal_unsharded_over_ragged_steps_and_evictions(runners):
    sharded, single = runners
    calls = [ExtendCall("a", list(range(5, 30)), 3), ExtendCall("b", list(range(40, 48)), 1),
             ExtendCall("c", [9, 8, 7], 2)]
    for step in range(6):
        for one, other in zip(sharded.extend_batch(calls), single.extend_batch(calls)):
            assert torch.allclose(one.logits, other.logits, atol=TOLERANCE, rtol=0), step
            assert (one.positions_fed, one.batch_rows) == (other.positions_fed, other.batch_rows)
        grown = [(c.tokens + [int(t) for t in range(11 + step, 13 + step)]) for c in calls]
        calls = [ExtendCall(c.seq_id, tokens, 2) for c, tokens in zip(calls, grown)]
    assert sharded.caches.evictions == single.caches.evictions > 0
    assert set(sharded.caches._entries) == set(single.caches._entries)


def test_each_shard_caches_its_own_heads(runners, zoo):
    sharded, single = runners
    sharded.extend_batch([ExtendCall("heads", [1, 2, 3, 4], 1)])
    single.extend_batch([ExtendCall("heads", [1, 2, 3, 4], 1)])
    sharded_keys = sharded.cached("heads")[0][0]     # [1, kv_heads / 2, 4, head_dim]
    whole_keys = single.cached("heads")[0][0]        # [1, kv_heads, 4, head_dim]
    assert sharded_keys.shape[1] * 2 == whole_keys.shape[1]
    assert torch.allclose(sharded_keys, whole_keys[:, :sharded_keys.shape[1]], atol=TOLERANCE)
    sharded.release("heads")
    assert "heads" not in sharded.caches


def _follower_killed_while_idle(target: str) -> dict:
    """A fresh 2-shard group (its own process: this one holds the module's), its follower
    killed while rank 0 runs no command: what rank 0 then saw."""
    told = []
    sharded = launch_local(ModelSpec(path=target), max_cached_tokens=BUDGET, world=2, on_broken=told.append)
    sharded.extend_batch([ExtendCall("alive", [1, 2, 3], 1)])
    killed = time.monotonic()
    os.kill(sharded.shards[1].pid, signal.SIGKILL)
    while not told and time.monotonic() < killed + 10:
        time.sleep(0.05)
    seen_s = time.monotonic() - killed
    try:
        sharded.extend_batch([ExtendCall("alive", [1, 2, 3, 4], 1)])
        next_command = "ran"
    except ShardGroupBroken as exc:
        next_command = f"ShardGroupBroken: {exc}"
    return {"told": told, "broken": sharded.broken, "seen_s": seen_s, "next_command": next_command}


def test_a_follower_gone_while_rank_0_is_idle_breaks_the_group_at_once(zoo):
    """NCCL would wait for a dead peer until its timeout: rank 0 watches the followers'
    processes rather than wait for a collective to fail (shard_group.PeerWatch). Killed while
    no command runs, the group is marked broken within seconds, on_broken is told once, and
    the next command fails with ShardGroupBroken without touching the group."""
    script = ("import json, sys; from tests.test_tensor_parallel import _follower_killed_while_idle as f; "
              "print(json.dumps(f(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", script, str(zoo.target)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["told"]) == 1 and "rank 1" in seen["told"][0] and seen["broken"] == seen["told"][0]
    assert seen["seen_s"] < 3
    assert seen["next_command"].startswith("ShardGroupBroken") and "rank 1" in seen["next_command"]


@pytest.fixture(scope="module")
def tp_app(ray_serve, zoo):
    shard = {"resources": {"num_cpus": 0.1}, "tp_size": 2}
    config = cluster_config(zoo.target, zoo.drafts["perturbed"], pools={"target": shard})
    yield deploy(ray_serve, "tp2", config)
    serve.delete("tp2")


@pytest.mark.parametrize("speculation", [{"k": 4}, {"k": 1}, {"enabled": False}], ids=["k4", "k1", "off"])
def test_greedy_over_http_with_two_shards_equals_the_target_alone(tp_app, greedy_reference, speculation):
    for prompt in PROMPTS[:4]:
        out = complete(tp_app, prompt, max_tokens=24, speculation=speculation)
        assert out["choices"][0]["token_ids"] == greedy_reference(prompt, 24), prompt
    streamed = reassemble(stream_chunks(tp_app, PROMPTS[4], max_tokens=24, speculation=speculation))
    assert streamed["choices"][0]["token_ids"] == greedy_reference(PROMPTS[4], 24)


def test_structured_output_with_two_shards_equals_the_target_alone_on_one(tp_app, apps):
    """A grammar's masks are applied by the engine over the group's logits (replicas/grammar.py)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for prompt in PROMPTS[:2]:
        constrained = {"structured_outputs": {"json": schema}, "max_tokens": 40}
        sharded = complete(tp_app, prompt, speculation={"k": 4}, **constrained)["choices"][0]
        alone = complete(apps["perturbed"], prompt, speculation={"enabled": False}, **constrained)["choices"][0]
        assert sharded["token_ids"] == alone["token_ids"] and sharded["finish_reason"] == "stop", prompt
        assert set(json.loads(sharded["text"])) == {"n", "ok"}


def test_a_tp_replica_runs_its_shards_together(tp_app):
    state = serve.get_deployment_handle("target", app_name="tp2").describe.remote().result()
    assert state["tp_size"] == 2 and [s["rank"] for s in state["shards"]] == [0, 1]
    assert state["shards"][0]["pid"] == state["pid"] != state["shards"][1]["pid"]
    assert {s["node_id"] for s in state["shards"]} == {state["node_id"]}


def test_a_shard_killed_mid_stream_costs_a_restart_not_a_token(tp_app, greedy_reference):
    target = serve.get_deployment_handle("target", app_name="tp2")
    before = target.describe.remote().result()
    prompt = max(PROMPTS, key=lambda p: len(greedy_reference(p, 200)))
    chunks = stream_chunks(tp_app, prompt, max_tokens=200, speculation={"k": 1})
    first = next(chunks)
    os.kill(before["shards"][1]["pid"], signal.SIGKILL)
    result = reassemble([first, *chunks])
    assert result["choices"][0]["token_ids"] == greedy_reference(prompt, 200)
    assert result["speculation"]["retried_calls"] > 0
    after = target.describe.remote().result()
    assert after["pid"] != before["pid"] and after["shards"][1]["pid"] != before["shards"][1]["pid"]


def test_the_draft_pool_shards_on_its_own(ray_serve, zoo, greedy_reference):
    # draft at tp_size 2 beside a target at 1: vLLM forces them equal, specserve does not
    pools = {"draft": {"resources": {"num_cpus": 0.1}, "tp_size": 2}}
    url = deploy(ray_serve, "draft-tp2", cluster_config(zoo.target, zoo.drafts["copy"], pools=pools))
    try:
        wait_for_the_draft_pool(url)     # its two shards may still be loading when the target answers
        out = complete(url, PROMPTS[0], max_tokens=24, speculation={"k": 4})
        assert out["choices"][0]["token_ids"] == greedy_reference(PROMPTS[0], 24)
        assert out["speculation"]["acceptance_rate"] >= 0.95     # the draft is the target itself
        state = serve.get_deployment_handle("draft", app_name="draft-tp2").describe.remote().result()
        target = serve.get_deployment_handle("target", app_name="draft-tp2").describe.remote().result()
        assert (state["tp_size"], target["tp_size"]) == (2, 1)
    finally:
        serve.delete("draft-tp2")
