"""The engine benchmark runs where Ray is not installed (the GPU test machine has torch and
transformers only) and reports every shape it was asked for against the bandwidth floor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WITHOUT_RAY = ("import runpy, sys; sys.modules['ray'] = None; "     # `import ray` now fails
               "sys.argv = ['engine'] + sys.argv[1:]; runpy.run_module('cluster.bench.engine', run_name='__main__')")


def test_the_engine_bench_runs_without_ray_and_reports_every_shape():
    result = subprocess.run([sys.executable, "-c", WITHOUT_RAY, "--random-llama", "tiny", "--device", "cpu",
                             "--dtype", "float32", "--sequences", "1", "3", "--positions", "1", "4",
                             "--context", "24", "--repeats", "2"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    shapes = [(row["sequences"], row["positions"]) for row in report["rows"]]
    assert shapes == [(1, 1), (1, 4), (3, 1), (3, 4)]
    # the floor is the weights' bytes over the measured copy bandwidth
    assert report["decode_floor_ms"] == pytest.approx(
        report["weight_bytes"] / report["copy_bandwidth_bytes_s"] * 1000, rel=0.01)
    for row in report["rows"]:
        assert row["engine_over_plain"] == pytest.approx(row["engine_ms"] / row["plain_ms"], rel=0.01)


def test_a_named_size_has_the_shape_of_its_model():
    from cluster.bench.engine import random_llama, weight_bytes
    import torch

    model = random_llama("70b-layers=1", torch.device("meta"), torch.bfloat16)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (8192, 1, 8)
    hidden, vocab, mlp, kv = 8192, 128256, 28672, 8 * 128
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden   # attention, MLP, 2 norms
    assert weight_bytes(model) == 2 * (2 * vocab * hidden + layer + hidden)          # bf16, embeddings, lm_head, norm


def test_acceptance_rules_keep_what_their_formulas_say():
    """A draft identical to the target: drafts sampled with q are always kept, and so are
    seeded drafts under shared noise (the same choice); greedy drafts judged one-hot are kept
    with the target's top probability, less than 1."""
    import torch

    from experiments.acceptance_rules import keep_rates
    from training.tiny_models import tiny_llama

    model = tiny_llama("target", 64, eos_token_id=0, seed=3)
    prompts = [[(7 * i + 3 * j) % 63 + 1 for j in range(40)] for i in range(3)]
    rates = keep_rates(model, model, prompts, temperature=1.0)
    with torch.inference_mode():
        top = torch.cat([torch.softmax(model(torch.tensor([p])).logits[0, 20:], -1).max(-1).values for p in prompts])
    assert rates["sampled_draft_with_q"] == 1.0 == rates["seeded_gumbel_shared_noise"]
    assert rates["greedy_draft_one_hot"] == round(top.mean().item(), 4) < 1.0
    other = keep_rates(model, tiny_llama("draft", 64, eos_token_id=0, seed=4), prompts, temperature=1.0)
    assert other["seeded_gumbel_shared_noise"] <= other["sampled_draft_with_q"] + 0.02     # at most 1 - TV
