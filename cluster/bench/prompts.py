"""Fresh prompts for `specserve bench`: the openings of functions in the third-party packages
installed beside this Python, each sent once.

Why: a prompt asked again is not what speculation meets in real traffic. The suffix method
drafts from the router's recent outputs, so a prompt it has answered before is drafted whole
from its cache: the bench's old prompts (training/corpus.py's held-out files, the same few for
every mode and every repeat) measured that cache, not speculation. And the bundled models
were trained on the standard library (training/corpus.py), so prompts from it are text the
models have seen. A fresh prompt comes from code that is neither: a Python function of an
installed third-party package (ray, transformers, pydantic, numpy, ...), cut where its body
begins, so that the model writes the body.

A prompt is the `prompt_tokens` tokens of source text just before the point right after a
`def ...:` line, that line's break and the indentation of the function's first statement
included: preceding code, ending where the body starts. The search is deterministic (the same
packages give the same prompts in the same order) and spread out: the packages of every
search root (this Python's purelib and platlib, `search_roots()`) take turns, in order of name,
each giving its next prompt from its files in order of path, at most FUNCTIONS_PER_FILE
functions a file, evenly spaced in it. Left out: the standard library, this project's own
packages, files that do not read or decode, functions with fewer than `prompt_tokens` tokens
before them, and files and windows whose lines are mostly lines of the standard library (the
copies of it that packages vendor: setuptools' distutils, tomli, importlib_resources, ...).
"""

from __future__ import annotations

import ast
import bisect
import functools
import itertools
import os
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

# This project's packages (installed into site-packages where it is not installed editable).
PROJECT_PACKAGES = frozenset({"cluster", "replicas", "router", "training", "tests"})
FUNCTIONS_PER_FILE = 3
MAX_FILE_BYTES = 400_000      # larger files (generated tables, vendored bundles) are skipped
MIN_LINE_CHARS = 8            # shorter lines (`else:`, `return x`) are too common to tell a copy
STDLIB_LINE_SHARE = 0.5       # a file or window with this share of its lines in the stdlib copies it
MIN_FILE_LINES = 10           # a file with fewer lines to tell it by is judged by its windows only


def search_roots() -> list[Path]:
    """This Python's site-packages folders (purelib, platlib), each once."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("purelib", "platlib"):
        root = Path(paths[key])
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def fresh_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `prompt_tokens` token ids, each ending where a
    function's body starts in a third-party package's source (the module docstring). Raises
    ValueError when the installed packages hold fewer."""
    if count <= 0:
        return []
    if prompt_tokens <= 0:
        raise ValueError(f"prompt_tokens must be positive, not {prompt_tokens}")
    roots = search_roots()
    stdlib = _stdlib_lines(str(Path(sysconfig.get_paths()["stdlib"]).resolve()))
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    candidates = _interleaved([_candidates(path, prompt_tokens, stdlib) for path in _packages(roots)])
    chars_per_token = 4.0    # a first guess of the text a window needs; then from the windows seen
    while len(prompts) < count:
        # tokenized a batch at a time (one call, in parallel), a few more than still needed
        batch = list(itertools.islice(candidates, max(64, min(1024, 2 * (count - len(prompts))))))
        if not batch:
            break
        want = prompt_tokens + _MARGIN_TOKENS
        windows = [(text, _line_start_before(text, end, int(want * chars_per_token)), end) for text, end in batch]
        encoded = tokenizer([text[start:end] for text, start, end in windows], add_special_tokens=False)["input_ids"]
        ratios = sorted((end - start) / len(ids) for (_, start, end), ids in zip(windows, encoded, strict=True) if ids)
        if ratios:
            chars_per_token = min(16.0, max(1.0, 1.2 * ratios[int(0.9 * (len(ratios) - 1))]))
        for (text, start, end), ids in zip(windows, encoded, strict=True):
            if len(ids) < want and start > 0:
                ids = _window(text, end, tokenizer, want, chars_per_token)   # short: from further back
            if len(ids) < prompt_tokens:
                continue
            prompt = list(ids[-prompt_tokens:])
            key = tuple(prompt)
            if key in seen or _window_copies_stdlib(tokenizer.decode(prompt), stdlib):
                continue
            seen.add(key)
            prompts.append(prompt)
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise ValueError(
            f"fresh_prompts: only {len(prompts)} distinct prompts of {prompt_tokens} tokens found in the "
            f"third-party packages under {', '.join(map(str, roots)) or '(no search roots)'}, {count} asked "
            f"for: ask for fewer requests or shorter prompts, install more packages, or use "
            f"--workload repeated")
    return prompts


def _packages(roots: list[Path]) -> list[Path]:
    """Every root's top-level packages and modules, by name (a name in two roots: the first's),
    without this project's, metadata and caches."""
    found: dict[str, Path] = {}
    for root in roots:
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            name = entry.name
            if name.startswith((".", "__editable__")) or name == "__pycache__":
                continue    # hidden, caches, and setuptools' finder of an editable install (this project's)
            if name.endswith((".dist-info", ".egg-info", ".data", ".libs")):
                continue
            if entry.is_dir(follow_symlinks=False):
                key = name
            elif name.endswith(".py") and entry.is_file(follow_symlinks=False):
                key = name[:-3]
            else:
                continue
            if key in PROJECT_PACKAGES or key in found:
                continue
            found[key] = Path(entry.path)
    return [found[key] for key in sorted(found)]


def _python_files(package: Path) -> Iterator[Path]:
    """The package's .py files in order of path, listed as they are reached."""
    if package.is_file():
        yield package
        return
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder, name)


def _interleaved(iterators: list[Iterator]) -> Iterator:
    """The iterators' items in turns: the first item of each, then the second of each, ..."""
    while iterators:
        active = []
        for iterator in iterators:
            item = next(iterator, _DONE)
            if item is not _DONE:
                active.append(iterator)
                yield item
        iterators = active


_DONE = object()


def _candidates(package: Path, prompt_tokens: int, stdlib: frozenset[str]) -> Iterator[tuple[str, int]]:
    """(text, end) of each function opening in the package: its file's text and where the
    function's body starts (files that copy the standard library left out)."""
    for path in _python_files(package):
        text = _read(path)
        if text is None or _copies_stdlib(text.split("\n"), stdlib, MIN_FILE_LINES):
            continue
        for end in _body_starts(text, FUNCTIONS_PER_FILE):
            if end >= prompt_tokens:                    # a token is a character or more
                yield text, end


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n")
    return None if "\r" in text else text


_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+[A-Za-z_]\w*[ \t]*[(\[]", re.MULTILINE)
_HEADER_END = re.compile(r"\)[ \t]*(?:->[^\n]*?)?:[ \t]*(?:#[^\n]*)?\n")
_TRIPLE_QUOTES = re.compile(r"\"\"\"|\'\'\'")


def _body_starts(text: str, most: int) -> list[int]:
    """Offsets in `text` right after a `def ...:` line, its line break and the indentation of
    the function's first statement, for at most `most` functions evenly spaced over the file
    (those whose body starts on the next line). Found by pattern, not by parsing the file (ten
    times slower): a header is checked by parsing it alone, and one inside a triple-quoted
    string (an odd number of triple quotes before it) is left out."""
    defs = list(_DEF.finditer(text))
    quotes = [m.start() for m in _TRIPLE_QUOTES.finditer(text)]
    ends = []
    for match in (defs[i] for i in _spread(len(defs), most)):
        if bisect.bisect_left(quotes, match.start()) % 2:
            continue                                            # in a docstring's example
        header = _HEADER_END.search(text, match.end(), match.end() + 2000)
        if header is None:
            continue
        body_start = header.end()
        body_end = text.find("\n", body_start)
        body = text[body_start:body_end if body_end >= 0 else len(text)]
        indent = len(body) - len(body.lstrip(" \t"))
        if indent <= len(match.group(1)) or not body.strip() or body.lstrip().startswith("#"):
            continue                                            # a one-line def, a blank or a comment next
        try:
            ast.parse(textwrap.dedent(text[match.start():body_start]) + "    pass\n")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue                                            # not a def header after all
        ends.append(body_start + indent)
    return ends


def _spread(n: int, most: int) -> list[int]:
    """At most `most` of the indices 0..n-1, evenly spaced, first and last included."""
    if n <= most:
        return list(range(n))
    return [round(i * (n - 1) / (most - 1)) for i in range(most)] if most > 1 else [0]


_MARGIN_TOKENS = 8       # tokens beyond the prompt's: a window's first, cut at a line start, may differ from the file's


def _line_start_before(text: str, end: int, chars: int) -> int:
    """The first line start at or after `chars` characters before `end` (0: the file's)."""
    start = max(0, end - chars)
    return text.find("\n", start, end) + 1 or start if start > 0 else 0


def _window(text: str, end: int, tokenizer, tokens: int, chars_per_token: float) -> list[int]:
    """The ids of the text before `end` from a line start far enough back to hold `tokens` of
    them, or from the file's start."""
    chars = int(tokens * chars_per_token * 2)
    while True:
        start = _line_start_before(text, end, chars)
        ids = tokenizer.encode(text[start:end], add_special_tokens=False)
        if len(ids) >= tokens or start == 0:
            return ids
        chars *= 2


def _copies_stdlib(lines: list[str], stdlib: frozenset[str], fewest: int = 1) -> bool:
    """Whether the share STDLIB_LINE_SHARE or more of `lines` (those of MIN_LINE_CHARS or more,
    stripped) are lines of the standard library; False where fewer than `fewest` count."""
    lines = [line for line in map(str.strip, lines) if len(line) >= MIN_LINE_CHARS]
    if len(lines) < fewest:
        return False
    return sum(line in stdlib for line in lines) >= STDLIB_LINE_SHARE * len(lines)


def _window_copies_stdlib(window: str, stdlib: frozenset[str]) -> bool:
    """Whether the window's whole lines (not its first, which may be cut, nor its last, the
    body's indentation) are mostly lines of the standard library. A window too short to hold
    any is judged with its file (_candidates)."""
    return _copies_stdlib(window.split("\n")[1:-1], stdlib)


@functools.lru_cache(maxsize=2)
def _stdlib_lines(root: str) -> frozenset[str]:
    """Every stripped line of MIN_LINE_CHARS or more of the standard library's .py files (the
    bundled models' corpus, training/corpus.py: site-packages left out)."""
    lines: set[str] = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                try:
                    data = Path(folder, name).read_bytes().decode("utf-8", errors="replace")
                except OSError:
                    continue
                lines.update(line for line in map(str.strip, data.split("\n")) if len(line) >= MIN_LINE_CHARS)
    return frozenset(lines)
