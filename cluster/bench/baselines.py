"""What the served numbers are compared with, measured in the bench's own process.

- Hugging Face transformers assisted generation (`generate(assistant_model=...)`) on the same
  weights and prompts, one request at a time (the only way transformers runs it).
- The analytic ideal of Leviathan et al. 2023 (Fast Inference from Transformers via
  Speculative Decoding, eq. for the walltime improvement): a round of k drafts costs
  k * c + 1 target-forward times, c being the draft/target cost ratio, and yields
  (1 - a^(k+1)) / (1 - a) tokens in expectation. We use the tokens per round actually
  measured in place of that expectation, so the ideal is what a system with no overhead
  at all would reach at the measured acceptance.
- vLLM's own speculative decoding: cluster/bench/vllm_compare.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm


@dataclass(frozen=True)
class HFAssisted:
    target_only_tokens_per_s: float
    assisted_tokens_per_s: float
    speedup: float
    identical_outputs: bool     # assisted greedy tokens == target greedy tokens, every prompt
    prompts: int
    num_assistant_tokens: int


def _generate(model, prompt: list[int], max_tokens: int, eos: int, **kwargs) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos, **kwargs)
    return out[0, len(prompt):].tolist(), time.perf_counter() - started


@torch.inference_mode()
def hf_assisted_generation(target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_tokens: int,
                           k: int, eos: int) -> HFAssisted:
    target = load_causal_lm(ModelSpec(path=target_dir, device="cpu"))
    draft = load_causal_lm(ModelSpec(path=draft_dir, device="cpu"))
    # A fixed k, as specserve uses, instead of transformers' default adaptive schedule.
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    _generate(target, prompts[0], 4, eos)  # warm-up
    plain_tokens = assisted_tokens = 0
    plain_s = assisted_s = 0.0
    identical = True
    for prompt in prompts:
        plain, seconds = _generate(target, prompt, max_tokens, eos)
        plain_tokens, plain_s = plain_tokens + len(plain), plain_s + seconds
        assisted, seconds = _generate(target, prompt, max_tokens, eos, assistant_model=draft)
        assisted_tokens, assisted_s = assisted_tokens + len(assisted), assisted_s + seconds
        identical &= assisted == plain
    plain_rate, assisted_rate = plain_tokens / plain_s, assisted_tokens / assisted_s
    return HFAssisted(round(plain_rate, 2), round(assisted_rate, 2), round(assisted_rate / plain_rate, 3),
                      identical, len(prompts), k)


@torch.inference_mode()
def decode_step_ms(model_dirs: list[Path], context: int, steps: int = 60) -> list[float]:
    """Median time of one single-token forward pass with `context` cached positions, per
    model. The models take turns step by step, so a busy moment of the machine falls on all
    of them alike, and run on one thread, as each serving replica does (one CPU each)."""
    models = [load_causal_lm(ModelSpec(path=path, device="cpu")) for path in model_dirs]
    caches = [DynamicCache(config=model.config) for model in models]
    for model, cache in zip(models, caches):
        model(input_ids=torch.ones((1, context), dtype=torch.long), cache=cache, use_cache=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: list[list[float]] = [[] for _ in models]
    try:
        for _ in range(steps):
            for model, cache, model_times in zip(models, caches, times):
                started = time.perf_counter()
                model(input_ids=torch.ones((1, 1), dtype=torch.long), cache=cache, use_cache=True)
                model_times.append((time.perf_counter() - started) * 1000)
                cache.crop(-1)  # back to `context` positions
    finally:
        torch.set_num_threads(threads)
    return [statistics.median(model_times) for model_times in times]


def ideal_speedup(tokens_per_round: float, k: float, cost_ratio: float) -> float:
    """Leviathan et al.'s walltime improvement with measured tokens per round:
    tokens_per_round / (k * c + 1)."""
    return tokens_per_round / (k * cost_ratio + 1)
