"""Whether a model's shape splits into tensor-parallel shards: read by the config's checks at
the edge and by the shards themselves, which run where pydantic may not be installed (the
GPU checklist's machine)."""

from __future__ import annotations

from typing import Any


def shard_problems(shape: dict[str, Any], tp_size: int) -> list[str]:
    """What keeps a model of this shape (its config.json) from splitting into tp_size shards:
    whole attention heads, key/value heads and MLP features per shard."""
    if tp_size == 1:
        return []
    heads = shape.get("num_attention_heads")
    sizes = {"num_attention_heads": heads, "num_key_value_heads": shape.get("num_key_value_heads") or heads,
             "intermediate_size": shape.get("intermediate_size")}
    return [f"{name} ({size}) is not divisible by tp_size {tp_size}"
            for name, size in sizes.items() if isinstance(size, int) and size % tp_size]
