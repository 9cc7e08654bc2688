"""How many positions a replica's KV cache holds when `kv_cache.max_tokens` is "auto".

On a GPU: `kv_cache.memory_fraction` of the device memory left free once the weights are
loaded, divided by what one cached position costs: keys and values, every layer, the key/value
heads this process holds (a tensor-parallel shard its own), in the model's dtype. The slots are
allocated as sequences arrive (kv_cache.py), so this is the budget they grow to, and a GPU's
replica neither wastes most of its memory nor runs out of it on a fixed count written for
another model. On a CPU, where the host's memory is shared with the router, the draft pool and
Ray, a fixed DEFAULT_CPU_TOKENS.
"""

from __future__ import annotations

import torch

DEFAULT_CPU_TOKENS = 32768


def position_bytes(model) -> int:
    """Bytes one cached position takes: a key and a value per layer and key/value head held."""
    config = getattr(model.config, "text_config", model.config)
    attention = model.get_decoder().layers[0].self_attn
    kv_width = attention.k_proj.out_features           # this process's heads (a shard: its own)
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_width * itemsize


def kv_cache_tokens(setting: int | str, model, device: torch.device, memory_fraction: float,
                    free_bytes: int | None = None) -> int:
    """The max_tokens a replica runs with: `setting` when a number; for "auto" the GPU's free
    memory (free_bytes, default what CUDA says now) times memory_fraction over position_bytes."""
    if setting != "auto":
        return int(setting)
    if device.type != "cuda" and free_bytes is None:
        return DEFAULT_CPU_TOKENS
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    tokens = int(free_bytes * memory_fraction) // position_bytes(model)
    if tokens < 1:
        raise RuntimeError(f"no room for a KV cache: {free_bytes} bytes free on {device} after the weights, "
                           f"{position_bytes(model)} a position")
    return tokens
