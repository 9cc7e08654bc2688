"""Tiny Llama-architecture models with RANDOM weights, saved in Hugging Face format.

They exist so that the serving path can run and be tested before trained weights do: the
tests build target/draft pairs from them, and `specserve up` builds an untrained placeholder
pair when cluster.yaml asks for one. Their text is noise; their exactness properties are
real. Everything is seeded, so a build is reproducible.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from training.bpe import fit_bpe

UNTRAINED_NOTE = "UNTRAINED placeholder: random weights, output is noise. Built by specserve."
# A fixed set of standard-library files, present wherever Python is, to fit a BPE vocabulary.
_TOKENIZER_CORPUS = ("os.py", "argparse.py", "typing.py", "dataclasses.py", "textwrap.py")

# Sizes by role: a "target" and a cheaper "draft".
ROLE_SIZES = {
    "target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
}


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE fitted on a few standard-library sources (deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in _TOKENIZER_CORPUS
             if (stdlib / name).is_file()]
    return fit_bpe(texts, vocab_size)


def tiny_llama(role: str, vocab_size: int, eos_token_id: int, seed: int,
               max_position_embeddings: int = 2048, initializer_range: float = 0.2) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                         bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                         initializer_range=initializer_range, tie_word_embeddings=False,
                         **ROLE_SIZES[role])
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """The same architecture and weights plus seeded Gaussian noise of relative size `scale`."""
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in copy.parameters():
            noise = torch.randn(weight.shape, generator=generator)
            weight.add_(noise * scale * weight.std().clamp(min=1e-3))
    return copy


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path, note: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text(f"# {path.name}\n\n{note}\n")
    return path


def build_placeholder_pair(target_dir: Path | None, draft_dir: Path | None, seed: int = 0) -> None:
    """Build the untrained target and/or draft into the given folders, sharing one tokenizer."""
    transformers_logging.disable_progress_bar()
    tokenizer = train_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    if target_dir is not None:
        save(tiny_llama("target", vocab, eos, seed), tokenizer, target_dir, UNTRAINED_NOTE)
    if draft_dir is not None:
        save(tiny_llama("draft", vocab, eos, seed + 1), tokenizer, draft_dir, UNTRAINED_NOTE)
