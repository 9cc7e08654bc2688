"""A cluster without a draft model: a router and a target pool, speculating by prompt lookup
(replicas/drafting/lookup.py). Through HTTP on the session's Ray: greedy output is the target alone's,
no draft deployment exists, and a method that needs the draft pool is refused."""

from __future__ import annotations

import httpx
import pytest
import yaml
from ray import serve

from cluster.config import ConfigError
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import complete, stream_complete


def test_without_a_draft_model_the_cluster_drafts_by_lookup(zoo):
    config = cluster_config(zoo.target, None)
    assert config.models.draft is None and config.pool_names == ("router", "target")
    assert (config.speculation.method, config.speculation.methods) == ("ngram", ["ngram", "suffix"])


@pytest.mark.parametrize("speculation, named", [({"method": "draft_model"}, "draft_model"),
                                                ({"methods": ["ngram", "hybrid"]}, "hybrid")])
def test_draft_pool_methods_without_a_draft_model_are_refused(zoo, speculation, named):
    with pytest.raises(ConfigError) as refused:
        cluster_config(zoo.target, None, speculation=speculation)
    assert any(named in problem and "models.draft" in problem for problem in refused.value.problems)


def test_the_vllm_engine_without_a_draft_model_drafts_by_its_own_lookup(zoo):
    from replicas.engines.vllm.target import speculative_config

    config = cluster_config(zoo.target, None, pools={"target": {"engine": "vllm"}})
    assert config.speculation.method == "ngram" and config.pool_names == ("router", "target")
    assert speculative_config("ngram", 3) == {"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert speculative_config("draft_model", 3)["method"] == "custom_class"
    with pytest.raises(ConfigError) as refused:
        cluster_config(zoo.target, None, pools={"target": {"engine": "vllm"}}, speculation={"method": "draft_model"})
    assert any("models.draft" in problem for problem in refused.value.problems)


@pytest.fixture(scope="module")
def lookup_only(ray_serve, zoo):
    url = deploy(ray_serve, "lookup-only", cluster_config(zoo.target, None))
    yield url
    serve.delete("lookup-only")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_cluster_without_a_draft_pool_serves_the_targets_greedy_output(lookup_only, greedy_reference, stream):
    call = stream_complete if stream else complete
    assert set(serve.status().applications["lookup-only"].deployments) == {"router", "target"}
    drafted = {"ngram": 0, "suffix": 0}
    for method in drafted:
        for prompt in PROMPTS[:4]:
            got = call(lookup_only, prompt, max_tokens=32, speculation={"k": 6, "method": method})
            assert got["choices"][0]["token_ids"] == greedy_reference(prompt, 32)
            kinds = got["speculation"]["by_kind"]
            assert kinds["draft_model"]["drafted_tokens"] == 0 and got["speculation"]["fallback_rounds"] == 0
            drafted[method] += kinds[method]["drafted_tokens"]
    assert min(drafted.values()) > 0


def test_lookup_requests_follow_the_controllers_choice_of_k(lookup_only, greedy_reference):
    """A request that fixes no k gets it from the router's goodput controller
    (router/k_control.py), priced on lookup's own keep chances: exact whatever it chooses."""
    rounds = 0
    for prompt in PROMPTS[:2]:
        got = complete(lookup_only, prompt, max_tokens=24)
        assert got["choices"][0]["token_ids"] == greedy_reference(prompt, 24)
        rounds += got["speculation"]["rounds"]
    state = serve.get_deployment_handle("router", app_name="lookup-only").describe.remote().result()["adaptive"]
    assert sum(state["k_by_method"]["ngram"].values()) >= rounds
    assert "draft_model" not in state["k_by_method"] and not state["plan"]["draft_call"]
    assert any(key.startswith("ngram/") for key in state["keep_chances"])


def test_a_cluster_without_a_draft_pool_refuses_the_draft_pools_methods(lookup_only):
    body = {"model": "specserve", "prompt": "x", "max_tokens": 4, "speculation": {"method": "hybrid"}}
    response = httpx.post(f"{lookup_only}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculation.method"
    sampled = complete(lookup_only, PROMPTS[0], max_tokens=12, temperature=0.9, seed=3)
    assert sampled["usage"]["completion_tokens"] == 12 or sampled["choices"][0]["finish_reason"] == "stop"


def test_its_kuberay_manifests_have_no_draft_workers(zoo, tmp_path):
    from cluster.kuberay import render_k8s

    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"models": {"target": {"path": str(zoo.target)}}}))
    service = yaml.safe_load(render_k8s(tmp_path / "cluster.yaml")["rayservice.yaml"])
    groups = [group["groupName"] for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert groups == ["router", "target"]
    [app] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert {deployment["name"] for deployment in app["deployments"]} == {"router", "target"}
