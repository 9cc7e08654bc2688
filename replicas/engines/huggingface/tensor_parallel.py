"""Tensor parallelism for Llama-family decoders (Llama, Mistral, Qwen2: q/k/v/o attention
projections and a gated MLP), in the manner of gpt-fast's `tp.py`.

Terms, for N shards and shard r:
- column parallel: a Linear split by output features. Shard r keeps rows
  [r*out/N, (r+1)*out/N) of the weight [out, in] and computes its own slice of the output.
  q/k/v are split this way along whole heads, so shard r computes attention for its own
  heads (num_heads/N query heads, num_kv_heads/N key/value heads); gate/up along MLP features.
- row parallel: a Linear split by input features. Shard r keeps columns
  [r*in/N, (r+1)*in/N) and produces a partial sum of the full output; an all-reduce (sum)
  over the shards makes every shard hold the whole output. o_proj and down_proj are split
  this way, each followed by the all-reduce: two per layer.
- replicated: embeddings, norms and lm_head stay whole on every shard, so every shard holds
  the same hidden states between layers and computes the same full logits [B, N, V].

The KV cache of a sequence is sharded with the heads for free: shard r's attention only ever
sees (and caches) its own key/value heads. Every shard runs the same batched forward on the
same inputs, so one ModelRunner per shard keeps its caches in step with the others.

    x ─┬─ q/k/v (column) ─ attention, own heads ─ o_proj (row) ─ all-reduce ─ + ─ ...
       └────────────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Split `model` in place into shard `rank` of `world`; returns it. The all-reduces run on
    `group` (the default process group when None). A model whose heads, key/value heads or MLP
    features do not split evenly is refused, before anything is cut (a served model's config
    is refused at the edge already, cluster.config.shard_problems; this module imports no
    pydantic, since the GPU checklist runs it where there is none)."""
    layers = _decoder_layers(model)
    problems = sorted({problem for layer in layers for problem in _split_problems(layer, world)})
    if problems:
        raise ValueError("; ".join(problems))
    for layer in layers:
        for name in _COLUMN:
            _keep_rows(layer.get_submodule(name), rank, world)
        for name in _ROW:
            linear = layer.get_submodule(name)
            _keep_columns(linear, rank, world)
            linear.register_forward_hook(_all_reduce_output(group))
    return model


def _split_problems(layer: nn.Module, world: int) -> list[str]:
    """The features each linear splits, in units that must stay whole on one shard: heads of
    head_dim features for attention, single features for the MLP."""
    head_dim = layer.self_attn.head_dim
    cut = {name: layer.get_submodule(name).out_features for name in _COLUMN}
    cut |= {name: layer.get_submodule(name).in_features for name in _ROW}
    problems = []
    for name, features in cut.items():
        unit = head_dim if name.startswith("self_attn.") else 1
        if features % (unit * world):
            whole = f"heads of {unit}" if unit > 1 else "features"
            problems.append(f"{name}'s {features} features do not split into {world} shards of whole {whole}")
    return problems


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not all(_has_llama_blocks(layer) for layer in layers):
        raise ValueError(f"tensor parallelism supports Llama-family decoders, not {type(model).__name__}")
    return layers


def _has_llama_blocks(layer: nn.Module) -> bool:
    try:
        return all(isinstance(layer.get_submodule(name), nn.Linear) for name in _COLUMN + _ROW)
    except AttributeError:
        return False


def _keep_rows(linear: nn.Linear, rank: int, world: int) -> None:
    """Column parallel: this shard's output features (rows of the weight [out, in])."""
    size = linear.out_features // world
    linear.weight = nn.Parameter(linear.weight[rank * size:(rank + 1) * size].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rank * size:(rank + 1) * size].clone(), requires_grad=False)
    linear.out_features = size


def _keep_columns(linear: nn.Linear, rank: int, world: int) -> None:
    """Row parallel: this shard's input features (columns of the weight [out, in]). The bias
    is added once over the sum, so only shard 0 keeps it."""
    size = linear.in_features // world
    linear.weight = nn.Parameter(linear.weight[:, rank * size:(rank + 1) * size].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = size


def checkpoint_slice(name: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[slice, ...] | None:
    """What shard `rank` keeps of the checkpoint's tensor `name` of `shape`, as _keep_rows and
    _keep_columns cut it: rows of a column-parallel weight or bias, columns of a row-parallel
    weight, everything of a replicated tensor; None for a row-parallel bias off shard 0 (zeros)."""
    module, kind = name.rsplit(".", 1)
    if any(module.endswith("." + column) for column in _COLUMN):
        size = shape[0] // world
        return (slice(rank * size, (rank + 1) * size),)
    if any(module.endswith("." + row) for row in _ROW):
        if kind == "bias":
            return (slice(None),) if rank == 0 else None
        size = shape[1] // world
        return (slice(None), slice(rank * size, (rank + 1) * size))
    return tuple(slice(None) for _ in shape)


def _all_reduce_output(group):
    def hook(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output
    return hook
