"""The training corpus of the bundled models: the standard library's own .py files.

Present on every machine with Python, so the pair can be rebuilt anywhere without a hub.
A fixed rule holds files out for evaluation: a file is held out when the BLAKE2b hash of its
path relative to the stdlib folder is 0 modulo HELD_OUT_MODULUS. The rule depends only on
the path, so the split is the same wherever the file exists.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_MODULUS = 25  # about 4 % of files


@dataclass(frozen=True)
class CorpusFile:
    name: str   # path relative to the stdlib folder, with forward slashes
    path: Path

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(name: str) -> bool:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_MODULUS == 0


def corpus_files(root: Path | None = None) -> list[CorpusFile]:
    root = root or stdlib_root()
    files = [CorpusFile(p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
             if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda f: f.name)


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files)."""
    train = [f for f in files if not is_held_out(f.name)]
    held_out = [f for f in files if is_held_out(f.name)]
    return train, held_out


def held_out_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` prompts of `prompt_tokens` ids from held-out files: each prompt is a window that
    ends mid-file, at a line start, so the continuation is more of the same file."""
    _, held_out = split(corpus_files())
    prompts = []
    for f in held_out:
        ids = tokenizer.encode(f.text())
        if len(ids) < prompt_tokens * 3:
            continue
        start = len(ids) // 3
        prompts.append(ids[start:start + prompt_tokens])
        if len(prompts) == count:
            break
    return prompts
