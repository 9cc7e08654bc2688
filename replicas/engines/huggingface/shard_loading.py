"""A tensor-parallel shard's weights, read straight from the checkpoint's safetensors: each
rank reads its own slice of every split matrix (tensor_parallel.py says which), in the
checkpoint's dtype or the one its device computes (loading.model_dtype), onto its device.

Loading the whole model and slicing it afterwards held every weight on every shard's host at
once: N copies of a 70 B model on a node of N GPUs. Here the model is built without storage
(on PyTorch's meta device), split, given storage on the shard's device, and filled tensor by
tensor; each tensor's file is opened for that tensor alone, so the memory map of a matrix
read by columns (row parallel: every row is touched) is let go before the next one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from replicas.engines.huggingface.loading import model_dtype
from replicas.engines.huggingface.tensor_parallel import checkpoint_slice, shard_model

if TYPE_CHECKING:     # the config's types only: the engines run without pydantic (gpu_check)
    from cluster.config import ModelSpec


@torch.no_grad()
def load_shard(spec: ModelSpec, rank: int, world: int, device: torch.device) -> PreTrainedModel:
    """Shard `rank` of `world` of the model in spec.path, on `device`, its all-reduces hooked
    (tensor_parallel.shard_model)."""
    path = Path(spec.path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=model_dtype(spec, device))
    shard_model(model, rank, world)
    model.to_empty(device=device)
    files = _tensor_files(path)
    for name, parameter in model.named_parameters():
        if name not in files:
            continue                  # a tied lm_head: tied again below
        with safe_open(files[name], framework="pt", device="cpu") as checkpoint:
            whole = checkpoint.get_slice(name)
            part = checkpoint_slice(name, tuple(whole.get_shape()), rank, world)
            parameter.copy_(torch.zeros_like(parameter) if part is None else whole[part])
    if "lm_head.weight" not in files and getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.get_input_embeddings().weight
    # RoPE's frequencies are buffers computed from the config, not stored: computed again
    base = model.model
    base.rotary_emb = type(base.rotary_emb)(config=config).to(device)
    return model.eval()


def _tensor_files(path: Path) -> dict[str, Path]:
    """Every tensor's name -> the safetensors file holding it (one file, or an index's shards)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path} has no model.safetensors (or index): a tensor-parallel shard reads "
                                f"its slices from safetensors")
    with safe_open(single, framework="pt", device="cpu") as checkpoint:
        return {name: single for name in checkpoint.keys()}
