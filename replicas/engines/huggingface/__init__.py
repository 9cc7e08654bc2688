"""The Hugging Face engine: transformers' weights (loading.py) through a lean Llama forward
(llama_forward.py) over preallocated KV slots (kv_cache.py, kv_storage.py), driven by a model
runner (model_runner.py), one process or a tensor-parallel group of shards (tensor_parallel.py,
shard_group.py), with the Proposer and Verifier on top (engine.py)."""

from __future__ import annotations

import gc
import logging
import os
from typing import TYPE_CHECKING, Literal

import torch

from replicas.engines.huggingface.engine import DraftEngine, Runner, TargetEngine
from replicas.grammar import GrammarMasks

if TYPE_CHECKING:     # the config's types only: the engines run without pydantic (gpu_check)
    from cluster.config import DraftPoolConfig, ModelSpec, TargetPoolConfig

__all__ = ["DraftEngine", "TargetEngine", "build"]

logger = logging.getLogger("ray.serve")


def build(role: Literal["draft", "target"], spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig,
          max_seq_len: int) -> DraftEngine | TargetEngine:
    runner = _runner(spec, pool, max_seq_len, role)
    if role == "target" and not _exact(runner, pool):
        device = runner.device
        del runner                          # never two copies of the weights at once
        _collect(device)
        runner = _runner(_float32(spec), pool, max_seq_len, role)
    if _auto_may_take_float32(spec, pool, runner):
        runner = _faster_of(runner, _runner(_float32(spec), pool, max_seq_len, role), pool.batching.max_batch_size)
    return (DraftEngine if role == "draft" else TargetEngine)(runner, _grammar_masks(spec))


def _grammar_masks(spec: ModelSpec) -> GrammarMasks | None:
    """Structured outputs' masks over the model's vocabulary, from the tokenizer in its folder
    (a draft folder may have none: it then drafts unmasked)."""
    has_tokenizer = any((spec.path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    return GrammarMasks(spec.path) if has_tokenizer else None


def _exact(runner: Runner, pool: TargetPoolConfig) -> bool:
    """Whether the target may run as loaded: a target in reduced precision runs only where its
    forward is batch-invariant (invariance.py); elsewhere in float32, with a warning. A
    draft's dtype moves no output."""
    if pool.tp_size > 1 or runner.model.dtype == torch.float32:    # a group's shards all-reduce: not probed alone
        return True
    from replicas.engines.huggingface.invariance import batch_invariant

    if batch_invariant(runner):
        return True
    logger.warning("the target's %s forward (row blocks: %s) is not batch-invariant on this machine (a verify's "
                   "logits would differ from single steps, and speculation would change greedy output): it is "
                   "loaded again in float32, after its %s weights are freed", runner.model.dtype,
                   getattr(runner.decoder, "row_block", None), runner.model.dtype)
    return False


def _collect(device: torch.device) -> None:
    """Free what was dropped (a runner's weights and caches) before anything else is loaded."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _auto_may_take_float32(spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig, runner: Runner) -> bool:
    """'auto' on a CPU that computes the checkpoint's reduced precision natively: either dtype
    is exact, so the faster is measured (dtype_choice.py). A tensor-parallel group is not."""
    return (spec.dtype == "auto" and pool.tp_size == 1 and runner.device.type == "cpu"
            and runner.model.dtype != torch.float32)


def _faster_of(reduced: Runner, full: Runner, max_rows: int) -> Runner:
    from replicas.engines.huggingface.dtype_choice import faster

    runners = {str(r.model.dtype).removeprefix("torch."): r for r in (reduced, full)}
    chosen, scores = faster(runners, max_rows)
    logger.info("dtype auto: forward ms (geometric mean over 1 and %d rows, 1 and 5 positions) %s: runs in %s",
                max_rows, scores, chosen)
    runners[chosen].dtype_scores_ms = scores
    return runners[chosen]


def _float32(spec: ModelSpec) -> ModelSpec:
    return spec.model_copy(update={"dtype": "float32"})


ROW_BLOCK = 128   # rows a GEMM for 'auto' (RowBlockLinear: padding a step's rows to it costs a GPU next to nothing)


def row_block(spec: ModelSpec, role: str, model) -> int | None:
    """The rows per GEMM of a target in reduced precision on the eager forward: spec.row_block,
    'auto' on a GPU only (a CPU's oneDNN kernels pass the invariance probe without)."""
    if role != "target" or spec.compile == "on" or model.dtype == torch.float32:
        return None
    if spec.row_block == "auto":
        return ROW_BLOCK if model.device.type == "cuda" else None
    return spec.row_block or None


def cuda_graphs_for(spec: ModelSpec, model) -> bool:
    """compile: auto on a GPU replays the eager forward's decode and verify passes from CUDA
    graphs (cuda_graphs.py)."""
    return spec.compile == "auto" and model.device.type == "cuda"


def _runner(spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig, max_seq_len: int, role: str) -> Runner:
    if pool.tp_size == 1:
        from replicas.engines.huggingface.loading import load_causal_lm

        if spec.compile == "on" and spec.compile_cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(spec.compile_cache_dir)   # read when inductor writes
        from replicas.engines.huggingface.kv_sizing import kv_cache_tokens
        from replicas.engines.huggingface.model_runner import ModelRunner

        model = load_causal_lm(spec)
        tokens = kv_cache_tokens(pool.kv_cache.max_tokens, model, model.device, pool.kv_cache.memory_fraction)
        return ModelRunner(model, tokens, max_seq_len, compiled=spec.compile == "on",
                           prefix_caching=pool.kv_cache.prefix_caching, fused_cpu=spec.compile == "auto",
                           fused_cache_dir=spec.compile_cache_dir, prefill_chunk=pool.prefill_chunk_tokens,
                           row_block=row_block(spec, role, model),
                           cuda_graphs=cuda_graphs_for(spec, model))
    from replicas.engines.huggingface.shard_group import launch_in_placement_group

    if spec.compile == "on":
        logger.warning("compile: on does not apply to a tensor-parallel group (its linears all-reduce in hooks); "
                       "the shards run eager")

    return launch_in_placement_group(spec, pool.kv_cache.max_tokens, max_seq_len, pool.tp_size,
                                     pool.resources.ray_actor_options(), pool.kv_cache.prefix_caching,
                                     pool.kv_cache.memory_fraction, pool.prefill_chunk_tokens)
