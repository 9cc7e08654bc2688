"""Loading Hugging Face-format models and tokenizers from local folders, never the network."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# Set before transformers reads it: a model path that is not a folder must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel  # noqa: E402

if TYPE_CHECKING:     # the config's types only: the engines run without pydantic (gpu_check)
    from cluster.config import ModelSpec


def pick_device(requested: str, reserved_gpus: list | None = None, cuda_available: bool | None = None) -> torch.device:
    """The device `requested` names; for "auto", a GPU only where this process holds one.

    Under Ray that means the GPUs Ray gave it (`ray.get_gpu_ids()`): Ray 2.60 no longer hides
    the node's GPUs from an actor that reserved none, so `torch.cuda.is_available()` alone
    would put a router's or a CPU pool's replica on cuda:0 beside the replica that reserved
    it. Outside Ray (a script, the tests' engines) any CUDA device will do. reserved_gpus and
    cuda_available default to what Ray and torch say; a test may say otherwise."""
    if requested != "auto":
        return torch.device(requested)
    reserved = ray_gpu_ids() if reserved_gpus is None else reserved_gpus
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if reserved is None:
        return torch.device("cuda" if available else "cpu")
    if reserved and not available:
        raise RuntimeError(f"Ray gave this replica GPU(s) {list(reserved)}, but torch sees no CUDA device "
                           f"(torch {torch.__version__}: a CPU-only build, or CUDA_VISIBLE_DEVICES emptied?). "
                           f"Install a CUDA build of torch on GPU nodes, or give the pool num_gpus: 0.")
    return torch.device("cuda" if reserved else "cpu")


def ray_gpu_ids() -> list | None:
    """The GPU ids Ray assigned to this process, or None outside a Ray worker."""
    try:
        import ray
    except ImportError:
        return None
    return ray.get_gpu_ids() if ray.is_initialized() else None


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


