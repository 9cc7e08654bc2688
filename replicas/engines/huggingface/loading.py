"""Loading Hugging Face-format models and tokenizers from local folders, never the network."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Set before transformers reads it: a model path that is not a folder must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402

from cluster.config import ModelSpec  # noqa: E402


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_causal_lm(spec: ModelSpec, device: torch.device | None = None) -> PreTrainedModel:
    """The model on `device` (default: the one spec.device picks)."""
    model = AutoModelForCausalLM.from_pretrained(
        Path(spec.path), dtype=getattr(torch, spec.dtype), local_files_only=True)
    return model.to(device or pick_device(spec.device)).eval()


def load_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
