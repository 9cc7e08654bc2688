"""The bundled, trained pair: small enough to ship, loads offline, and its draft is accepted
often enough through the real serving path that a broken sampler, cache or position
bookkeeping shows up as a drop below the floor."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.config import load_config
from training.corpus import held_out_prompts
from tests.conftest import cluster_config

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"
# The model card records the held-out acceptance at k = 4 (above 0.6 on 32 prompts); these 8
# prompts through the served path must stay above 0.5. A broken sampler, cache, batch layout
# or position bookkeeping drives acceptance towards 0.
ACCEPTANCE_FLOOR = 0.5
SIZE_LIMIT = 60 * 2**20


def test_committed_model_files_fit_the_budget():
    total = sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file())
    assert 0 < total <= SIZE_LIMIT


@pytest.mark.parametrize("role", ["target", "draft"])
def test_each_model_loads_alone_offline(role, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(MODELS / role, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / role, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_target_and_draft_share_the_tokenizer():
    assert (MODELS / "target" / "tokenizer.json").read_bytes() == (MODELS / "draft" / "tokenizer.json").read_bytes()


def test_default_cluster_serves_the_bundled_pair():
    config = load_config(REPO / "cluster.yaml")
    assert config.models.target.path == MODELS / "target"
    assert config.models.draft.path == MODELS / "draft"


def test_served_greedy_acceptance_stays_above_the_floor(ray_serve):
    from ray import serve

    from cluster.app import build_app

    config = cluster_config(MODELS / "target", MODELS / "draft")
    serve.run(build_app(config), name="bundled", route_prefix="/bundled")
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "target", local_files_only=True)
    drafted = accepted = 0
    for prompt in held_out_prompts(tokenizer, count=8, prompt_tokens=128):
        body = {"model": "specserve", "prompt": prompt, "max_tokens": 48, "temperature": 0,
                "speculation": {"k": 4}}
        response = httpx.post(f"{ray_serve}/bundled/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        stats = response.json()["speculation"]
        drafted, accepted = drafted + stats["drafted_tokens"], accepted + stats["accepted_tokens"]
    serve.delete("bundled")
    assert accepted / drafted >= ACCEPTANCE_FLOOR
