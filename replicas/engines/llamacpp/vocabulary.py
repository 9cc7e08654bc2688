"""Whether a GGUF file's token ids mean what the router's tokenizer means by them.

The router tokenizes with the Hugging Face tokenizer of the model's folder and sends token
ids; llama.cpp never tokenizes. So the file's vocabulary must name the same token under
every id, or the target would read other text than the client sent (and a draft would
propose ids its target reads differently). Both store a token as its vocabulary string
(byte-level BPE's 'Ġthe', SentencePiece's '▁the'), so they are compared string for string.
"""

from __future__ import annotations

import json
from pathlib import Path


class VocabularyMismatch(ValueError):
    """The GGUF file's vocabulary differs from the tokenizer the router uses."""


def hf_vocabulary(folder: Path) -> dict[int, str]:
    """Id -> token string of the folder's tokenizer.json, added tokens included."""
    tokenizer = json.loads((Path(folder) / "tokenizer.json").read_text())
    by_id = {index: text for text, index in tokenizer["model"]["vocab"].items()}
    by_id.update({added["id"]: added["content"] for added in tokenizer.get("added_tokens", [])})
    return by_id


def check_vocabulary(runner, folder: Path, shown: int = 5) -> None:
    """Refuse (VocabularyMismatch) a file whose token strings differ from the folder's by id,
    or that has fewer ids than the tokenizer uses."""
    expected = hf_vocabulary(folder)
    if max(expected) >= runner.vocab_size:
        raise VocabularyMismatch(f"the GGUF file has {runner.vocab_size} tokens; the tokenizer in {folder} uses ids "
                                 f"up to {max(expected)}")
    differing = [(i, text, runner.token_text(i)) for i, text in sorted(expected.items()) if runner.token_text(i) != text]
    if differing:
        examples = ", ".join(f"{i}: {hf!r} vs {gguf!r}" for i, hf, gguf in differing[:shown])
        raise VocabularyMismatch(f"{len(differing)} of {len(expected)} token ids name other tokens in the GGUF file "
                                 f"than in the tokenizer of {folder} (id: tokenizer vs file: {examples}); the model "
                                 "must be served with the tokenizer it was trained with")
