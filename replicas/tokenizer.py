"""The tokenizer of a model folder, for every part that needs one (the router, the engines,
training, the bench): from local files only (no model hub)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer


def load_tokenizer(path: Path | str):
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
