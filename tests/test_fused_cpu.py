"""The fused CPU forward (replicas/engines/huggingface/fused_cpu.py and .c): transformers'
modules' logits within float32 rounding and the same greedy choices, on the bundled pair and
grouped-query attention, over ragged batches of prefills, single steps and verifies; bitwise
batch-invariant (a sequence's logits are the same in any batch and however its positions were
split into calls, which is what makes a verify agree with the target alone's single steps);
eager wherever it does not apply or no C compiler is found; what `models.*.compile: auto`, the
default, runs on a CPU.
Every HTTP exactness test also runs it, since the test clusters run float32 on a CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.config import ModelSpec, load_config
from replicas.engines.huggingface import build
from replicas.engines.huggingface.fused_cpu import FusedCpuForward, load_library
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from tests.test_llama_forward import random_batches

# Float32 logits of these models reach about 14; a different summation order moves them by a
# few 1e-6 (measured at most 9e-6 on the bundled target); a wrong operation moves them by far more.
LOGIT_ATOL = 1e-4


def grouped_query_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def fused_runner(model, max_seq_len: int = 128) -> ModelRunner:
    runner = ModelRunner(model, 1 << 16, max_seq_len, fused_cpu=True)
    assert runner.fused
    return runner


def models():
    yield "target", load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    yield "draft", load_causal_lm(ModelSpec(path="models/draft", dtype="float32"))
    yield "grouped-query", grouped_query_llama()


@pytest.mark.parametrize("name, model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_logits_are_the_modules_within_float32_rounding(name, model):
    fused, modules = fused_runner(model), ModelRunner(model, 1 << 16, 128, lean=False)
    vocab = model.config.vocab_size
    for step, calls in enumerate(random_batches(vocab, seed=5, steps=12)):
        for call, a, b in zip(calls, fused.extend_batch(calls), modules.extend_batch(calls), strict=True):
            gap = (a.logits - b.logits).abs().max().item()
            assert gap < LOGIT_ATOL, f"step {step}, {call.seq_id}: {gap}"
            assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1)), f"step {step}, {call.seq_id}"


@pytest.mark.parametrize("name, model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_sequence_gets_bitwise_the_same_logits_in_any_batch_and_split(name, model):
    """Each call of ragged batches (several sequences, one to five new positions on a cache)
    against the same tokens computed alone in one prefill by a fresh runner."""
    batched = fused_runner(model)
    for step, calls in enumerate(random_batches(model.config.vocab_size, seed=6, steps=12)):
        for call, got in zip(calls, batched.extend_batch(calls), strict=True):
            alone = fused_runner(model).extend(call.seq_id, call.tokens, call.num_logits)
            assert torch.equal(got.logits, alone.logits), (
                f"step {step}, {call.seq_id}: {(got.logits - alone.logits).abs().max()}")


def test_what_it_does_not_support_runs_eager():
    torch.manual_seed(0)
    small_heads = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4)).eval()   # head_dim 12
    biased = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, attention_bias=True)).eval()
    dynamic_rope = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})).eval()
    bfloat16 = load_causal_lm(ModelSpec(path="models/draft", dtype="bfloat16"))
    for model in (small_heads, biased, dynamic_rope, bfloat16):
        assert not FusedCpuForward.supports(model)
        runner = ModelRunner(model, 1 << 12, 64, fused_cpu=True)
        assert runner.lean and not runner.fused


def test_without_a_c_compiler_it_warns_and_runs_eager(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    model = load_causal_lm(ModelSpec(path="models/draft", dtype="float32"))
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(model, 1 << 12, 64, fused_cpu=True, fused_cache_dir=tmp_path)
    assert not runner.fused and runner.lean
    assert "no C compiler" in caplog.text
    assert load_library(tmp_path) is None


def test_the_library_is_built_once_into_the_cache_folder(tmp_path):
    assert load_library(tmp_path) is not None
    built = sorted(tmp_path.glob("fused_cpu_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert load_library(tmp_path) is not None
    assert built[0].stat().st_mtime_ns == stamp and sorted(tmp_path.glob("*")) == built


def test_the_default_config_serves_the_bundled_pair_fused(tmp_path):
    config = load_config("cluster.yaml")
    for role in ("target", "draft"):
        spec = getattr(config.models, role).model_copy(update={"dtype": "float32"})
        assert spec.compile == "auto"
        pool = getattr(config.pools, role)
        engine = build(role, spec, pool, 128)
        assert engine.describe()["fused_cpu"] is True
        off = build(role, spec.model_copy(update={"compile": "off"}), pool, 128)
        assert off.describe()["fused_cpu"] is False
        calls = [ExtendCall("a", list(range(1, 40)), 3)]
        assert torch.equal(engine.runner.extend_batch(calls)[0].logits.argmax(-1),
                           off.runner.extend_batch(calls)[0].logits.argmax(-1))
