"""The compiled layers (`models.*.compile: on`, replicas/engines/huggingface/llama_forward.py):
logits within float32 rounding of the eager forward over every shape class and ragged
batches, and greedy speculation on compiled engines equal to Hugging Face's greedy generate()
of the target alone, for k 1, 3 and 5 and three draft regimes. One process compiles once, so
the module pays the compile time once (about a minute here)."""

from __future__ import annotations

import pytest
import torch

from cluster.bench.gpu_check import GREEDY_PROMPTS as PROMPTS, greedy_alone, speculate
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from training.tiny_models import perturbed_copy, tiny_llama

VOCAB = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models():
    target = tiny_llama("target", VOCAB, eos_token_id=0, seed=3)
    return {"target": target, "copy": target, "perturbed": perturbed_copy(target, 0.05, seed=4),
            "unrelated": tiny_llama("draft", VOCAB, eos_token_id=0, seed=11)}


def grouped_query_llama():
    """Two query heads per key/value head: the grouped attention paths (Llama 3's layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("layout", ["heads", "grouped"])
def test_the_compiled_forward_gives_the_eager_logits(models, layout):
    target = models["target"] if layout == "heads" else grouped_query_llama()
    eager = ModelRunner(target, max_cached_tokens=4000, max_seq_len=128)
    compiled = ModelRunner(target, max_cached_tokens=4000, max_seq_len=128, compiled=True)
    assert compiled.compile_s is not None and isinstance(compiled.decoder.steps[0], type(torch.compile(len)))
    # one row and several, one new position and several, ragged prefills over cached rows
    batches = [[ExtendCall("a", PROMPTS[0], 1)], [ExtendCall("a", PROMPTS[0] + [7], 1)],
               [ExtendCall("b", PROMPTS[1], 3), ExtendCall("c", PROMPTS[2], 2)],
               [ExtendCall("a", PROMPTS[0] + [7, 8, 9, 10], 5), ExtendCall("b", PROMPTS[1] + [1], 2),
                ExtendCall("c", PROMPTS[2] + [4, 4], 3)]]
    for batch in batches:
        for want, got in zip(eager.extend_batch(batch), compiled.extend_batch(batch)):
            assert got.positions_fed == want.positions_fed
            assert torch.allclose(got.logits, want.logits, atol=1e-4), (got.logits - want.logits).abs().max()


@pytest.mark.parametrize("regime", ["copy", "perturbed", "unrelated"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_on_compiled_engines_equals_the_target_alone(models, regime, k):
    verifier = TargetEngine.on_model(models["target"], max_cached_tokens=4000, max_seq_len=128, compiled=True)
    drafter = DraftEngine.on_model(models[regime], max_cached_tokens=4000, max_seq_len=128, compiled=True)
    assert verifier.describe()["compile_s"] is not None and drafter.describe()["compile_s"] is not None
    for i, prompt in enumerate(PROMPTS):
        assert (speculate(drafter, verifier, prompt, k, f"s{i}", MAX_TOKENS)
                == greedy_alone(models["target"], prompt, MAX_TOKENS))
