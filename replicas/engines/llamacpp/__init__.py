"""The llama.cpp engine (`engine: llamacpp`, the optional extra `specserve[llamacpp]`): a GGUF
model, quantized or not, in one llama.cpp context per replica that holds every sequence
(runner.py), under the same draft and target engines as the Hugging Face engine's
(replicas/engines/huggingface/engine.py): specserve's acceptance rule on llama.cpp's logits,
so drafts and targets of either engine mix in one cluster and stay exact. Its vocabulary is
checked against the router's tokenizer at start (vocabulary.py); gguf_export.py writes a
Hugging Face Llama folder as GGUF. Only this folder imports llama_cpp, and nothing imports
it until a replica runs it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from replicas.engines.huggingface.engine import DraftEngine, TargetEngine
from replicas.grammar import GrammarMasks

if TYPE_CHECKING:
    from cluster.config import DraftPoolConfig, ModelSpec, TargetPoolConfig

logger = logging.getLogger("ray.serve")

EXTRA_MISSING = ("engine: llamacpp needs llama-cpp-python on this node: install specserve[llamacpp] "
                 "(it builds llama.cpp from source; README, 'The llama.cpp engine')")


class LlamaCppDraftEngine(DraftEngine):
    def describe(self) -> dict:
        return self.runner.describe()

    def holds(self, seq_id: str) -> bool:
        return self.runner.holds(seq_id)


class LlamaCppTargetEngine(TargetEngine):
    def describe(self) -> dict:
        return self.runner.describe() | {"engine_drafts": dict(self.engine_drafts)}

    def holds(self, seq_id: str) -> bool:
        return self.runner.holds(seq_id)


def build(role: Literal["draft", "target"], spec: ModelSpec, pool: DraftPoolConfig | TargetPoolConfig,
          max_seq_len: int) -> LlamaCppDraftEngine | LlamaCppTargetEngine:
    try:
        from replicas.engines.llamacpp.gguf_export import write_if_missing
        from replicas.engines.llamacpp.runner import LlamaCppRunner, threads_for
    except ImportError as exc:
        raise RuntimeError(f"{EXTRA_MISSING} ({exc})") from exc
    from replicas.engines.llamacpp.vocabulary import check_vocabulary

    if write_if_missing(spec):
        logger.info("llama.cpp %s: wrote %s (%s) from %s", role, spec.path, spec.gguf_type, spec.tokenizer)

    options = pool.llamacpp
    max_tokens = pool.kv_cache.max_tokens if pool.kv_cache.max_tokens != "auto" else 32768
    runner = LlamaCppRunner(spec.path, max_tokens, max_seq_len, max_sequences=2 * pool.max_ongoing_requests,
                            threads=options.threads or threads_for(pool.resources.num_cpus),
                            kv_type=options.kv_type, prefix_caching=pool.kv_cache.prefix_caching,
                            gpu_layers=options.gpu_layers, repack=options.repack,
                            # a draft's numbers need not match any other pass's: its lone steps
                            # compute their one position (1.5-2x cheaper, runner.py)
                            lone_step_window=role == "target")
    check_vocabulary(runner, spec.folder)
    logger.info("llama.cpp %s: %s, %d threads, KV cache %d positions (%s)", role, spec.path.name, runner.threads,
                runner.max_tokens, runner.kv_type)
    engine = LlamaCppDraftEngine if role == "draft" else LlamaCppTargetEngine
    return engine(runner, GrammarMasks(spec.folder))
