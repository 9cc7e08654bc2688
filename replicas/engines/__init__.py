"""The engines, one folder each, behind one seam (replicas/engines/protocol.py):

- huggingface/: the default engine. The model runs with transformers' weights through a lean
  Llama forward over preallocated KV slots, in the replica's process when `tp_size` is 1, or
  as a tensor-parallel group of `tp_size` shards (huggingface/shard_group.py) otherwise; it
  applies specserve's acceptance rule.
- llamacpp/: a GGUF file on llama.cpp (`engine: llamacpp`, a draft or target pool), under
  the same draft and target engines as huggingface/'s.
- vllm/: the target pool on vLLM (`pools.target.engine: vllm`), a deployment of its own that
  runs the rounds inside vLLM, drafting from specserve's draft pool (vllm/target.py).

The deployments (replicas/deployments.py) know the seam and `build_engine`, nothing inside a
folder; cluster/app.py picks the vLLM deployment where the config says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from replicas.engines.protocol import EngineBroken, Proposer, Verifier

if TYPE_CHECKING:     # the config's types only: the engines run without pydantic (gpu_check)
    from cluster.config import DraftPoolConfig, ModelSpec, TargetPoolConfig

__all__ = ["EngineBroken", "Proposer", "Verifier", "build_engine"]


def build_engine(role: Literal["draft", "target"], spec: ModelSpec,
                 pool: DraftPoolConfig | TargetPoolConfig, max_seq_len: int) -> Proposer | Verifier:
    """The pool's engine (`engine: huggingface` or `llamacpp`, the one a Proposer or Verifier
    deployment holds). max_seq_len: the longest sequence served (limits.context_length), the length of
    every KV slot."""
    if pool.engine == "llamacpp":
        from replicas.engines.llamacpp import build as build_llamacpp

        return build_llamacpp(role, spec, pool, max_seq_len)
    from replicas.engines.huggingface import build

    return build(role, spec, pool, max_seq_len)
