"""cluster/bench/prompts.py without Ray: the bench's fresh prompts are distinct, exactly as long
as asked, never text of the standard library (the bundled models' training corpus), the same
on every call, and a clear error when the packages hold fewer than asked for."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from cluster.bench import prompts
from cluster.bench.prompts import fresh_prompts
from replicas.tokenizer import load_tokenizer
from training.corpus import corpus_files, stdlib_root

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODELS / "target")


def test_fresh_prompts_are_distinct_exact_new_to_the_models_and_deterministic(tokenizer):
    found = fresh_prompts(tokenizer, 200, 96)
    assert len(found) == 200 and all(len(prompt) == 96 for prompt in found)
    assert len({tuple(prompt) for prompt in found}) == 200
    assert fresh_prompts(tokenizer, 200, 96) == found
    assert fresh_prompts(tokenizer, 50, 96) == found[:50]       # a longer run begins with a shorter's
    texts = [tokenizer.decode(prompt) for prompt in found]
    # each ends where a function's body starts: its `def ...:` line, a line break, an indentation
    for text in texts:
        *_, header, indent = text.split("\n")
        assert header.split("#")[0].rstrip().endswith(":") and indent and indent.strip() == ""
    assert sum("def " in text for text in texts) >= 150          # a long signature may hide its `def`
    assert len({text.split("\n")[-2] for text in texts}) >= 150    # many functions, not one name again and again
    # none is text of the standard library (the bundled models' training corpus)
    stdlib = "\n\0\n".join(f.text() for f in corpus_files())
    assert [text for text in texts if text in stdlib] == []


def test_fresh_prompts_leave_out_this_project_and_stdlib_copies_and_say_when_too_few(tokenizer, tmp_path, monkeypatch):
    ours = textwrap.dedent('''\
        """A package of our own: nothing in it is in the standard library."""

        FROBNICATION_LEVEL = 17
        ZORBLAX_TABLE = {"quux": 3, "blorp": 5, "snark": 8, "gloop": 13}


        def frobnicate_the_zorblax(quux_count: int) -> int:
            return quux_count * FROBNICATION_LEVEL + ZORBLAX_TABLE["quux"]


        def unfrobnicate_blorp_values(blorp_map: dict) -> dict:
            return {key: value - FROBNICATION_LEVEL for key, value in blorp_map.items()}
        ''')
    (tmp_path / "zorblax").mkdir()
    (tmp_path / "zorblax" / "__init__.py").write_text(ours)
    (tmp_path / "zorblax-1.0.dist-info").mkdir()
    # this project's own package and a vendored copy of a stdlib module: never used
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "__init__.py").write_text(ours.replace("zorblax", "router_zorblax"))
    (tmp_path / "vendored").mkdir()
    shutil.copy(stdlib_root() / "textwrap.py", tmp_path / "vendored" / "__init__.py")
    monkeypatch.setattr(prompts, "search_roots", lambda: [tmp_path])

    found = fresh_prompts(tokenizer, 2, 24)
    assert [len(prompt) for prompt in found] == [24, 24]
    for prompt in found:
        assert tokenizer.decode(prompt) in ours
    with pytest.raises(ValueError, match=r"only 2 distinct prompts of 24 tokens .* 3 asked for"):
        fresh_prompts(tokenizer, 3, 24)
