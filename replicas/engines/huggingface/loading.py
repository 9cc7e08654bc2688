"""Loading Hugging Face-format models and tokenizers from local folders, never the network."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Set before transformers reads it: a model path that is not a folder must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from cluster.config import ModelSpec  # noqa: E402


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_causal_lm(spec: ModelSpec, device: torch.device | None = None) -> PreTrainedModel:
    """The model on `device` (default: the one spec.device picks), in the dtype spec.dtype names."""
    device = device or pick_device(spec.device)
    model = AutoModelForCausalLM.from_pretrained(
        Path(spec.path), dtype=model_dtype(spec, device), local_files_only=True)
    return model.to(device).eval()


def model_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """spec.dtype; for 'auto' the checkpoint's dtype where `device` computes it natively, else
    float32 (a CPU without oneDNN's bfloat16 kernels runs bfloat16 by conversion, and float16
    on a CPU is slow everywhere)."""
    if spec.dtype != "auto":
        return getattr(torch, spec.dtype)
    checkpoint = getattr(AutoConfig.from_pretrained(Path(spec.path), local_files_only=True), "dtype", None)
    checkpoint = getattr(torch, checkpoint) if isinstance(checkpoint, str) else checkpoint or torch.float32
    if device.type == "cpu" and (checkpoint == torch.float16 or
                                 checkpoint == torch.bfloat16 and not _cpu_bfloat16()):
        return torch.float32
    return checkpoint


def _cpu_bfloat16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


