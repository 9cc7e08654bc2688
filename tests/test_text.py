"""router/text.py: incremental detokenisation with the real byte-level BPE tokenizer, and
stop-string filtering (held-back prefixes, splits across pieces, earliest stop wins)."""

from __future__ import annotations

import random

import pytest

from training.tiny_models import train_tokenizer
from router.text import IncrementalDetokenizer, StopStringFilter

REPLACEMENT = "\ufffd"

ASCII_CODE = (
    "import os\nimport sys\n\n"
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n        self.pos = 0\n\n"
    "    def peek(self) -> str:\n        return self.text[self.pos] if self.pos < len(self.text) else ''\n"
    "\n\tx = {'a': [1, 2, 3], \"b\": (4,)}  # comment !? ~`@$%^&*\n"
)
MULTIBYTE = "naïve café — 日本語 ✓"
TEXTS = {
    "ascii-code": ASCII_CODE,
    "multibyte": MULTIBYTE,
    "emoji": "ok 🙂👍🏽 done e\u0301 ΑΒΓ ж",
    "mixed": "def grüße():\n    return '日本語' + \"✓\" * 3  # naïve\n",
    "cjk-run": "日本語日本語日本語中文한국어",
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def push_all(tokenizer, ids: list[int], **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


# --- IncrementalDetokenizer ------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TEXTS))
def test_push_one_id_at_a_time_reproduces_decode(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    pieces, rest = push_all(tokenizer, ids)
    assert "".join(pieces) + rest == decode(tokenizer, ids) == TEXTS[name]
    assert rest == "", "complete text should leave nothing for flush()"


def test_multibyte_text_spans_several_tokens_per_character(tokenizer):
    """Guards the premise of the next test: some characters here are split over tokens."""
    ids = tokenizer.encode(MULTIBYTE)
    partial = [decode(tokenizer, ids[:n]) for n in range(1, len(ids) + 1)]
    assert any(text.endswith(REPLACEMENT) for text in partial)


@pytest.mark.parametrize("name", list(TEXTS))
def test_never_emits_a_replacement_char_for_a_character_completed_later(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    assert REPLACEMENT not in TEXTS[name]
    pieces, rest = push_all(tokenizer, ids)
    for n, piece in enumerate(pieces):
        assert REPLACEMENT not in piece, f"piece {n} ({piece!r}) contains U+FFFD"
    # Every emitted prefix is a prefix of the final text: nothing is ever taken back.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert TEXTS[name].startswith(emitted)


def test_a_split_character_is_held_then_released_whole(tokenizer):
    ids = tokenizer.encode("日")
    assert len(ids) > 1, "expected a CJK character to take several byte-level tokens"
    pieces, rest = push_all(tokenizer, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "日" and rest == ""


def test_flush_returns_an_unfinished_character_as_replacement(tokenizer):
    ids = tokenizer.encode("a日")
    detok = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detok.push(i) for i in ids[:-1])
    assert emitted == "a"
    tail = detok.flush()
    assert tail and set(tail) == {REPLACEMENT}
    assert emitted + tail == decode(tokenizer, ids[:-1])
    assert detok.flush() == ""


def test_flush_after_complete_text_is_empty_and_push_continues(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    first, second = tokenizer.encode("hello "), tokenizer.encode("wörld")
    text = "".join(detok.push(i) for i in first) + detok.flush()
    text += "".join(detok.push(i) for i in second) + detok.flush()
    assert text == decode(tokenizer, first + second)


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("x = 1") + [eos] + tokenizer.encode(" y")
    pieces, rest = push_all(tokenizer, ids)
    assert "".join(pieces) + rest == "x = 1 y"
    assert pieces[len(tokenizer.encode("x = 1"))] == ""


def test_literal_replacement_char_in_the_text_is_not_lost(tokenizer):
    text = "bad \ufffd byte"
    ids = tokenizer.encode(text)
    pieces, rest = push_all(tokenizer, ids)
    assert "".join(pieces) + rest == text


@pytest.mark.parametrize("context", [1, 2, 5, 16])
def test_random_id_sequences_match_decode(tokenizer, context):
    """Untrained models emit arbitrary ids, including stray bytes that never form a
    character: the pieces still add up to decode() of everything."""
    byte_ids = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    rng = random.Random(context)
    for _ in range(200):
        pool = byte_ids if rng.random() < 0.5 else range(len(tokenizer))
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        pieces, rest = push_all(tokenizer, ids, context=context)
        assert "".join(pieces) + rest == decode(tokenizer, ids), ids


# --- StopStringFilter ------------------------------------------------------------------------

def feed(stops: list[str], pieces: list[str], final: bool = True) -> tuple[list[str], StopStringFilter]:
    """add() each piece and release(final=False) after it; then release(final) once more."""
    f = StopStringFilter(stops)
    out = []
    for piece in pieces:
        f.add(piece)
        out.append(f.release(final=False))
        if f.stopped:
            break
    out.append(f.release(final=final))
    return out, f


def test_stop_in_one_piece():
    out, f = feed(["STOP"], ["hello STOP world"])
    assert f.stopped
    assert "".join(out) == "hello "


def test_stop_at_the_very_start():
    out, f = feed(["\n\n"], ["\n\nafter"])
    assert f.stopped and "".join(out) == ""


def test_stop_split_across_several_adds():
    out, f = feed(["<END>"], ["abc <", "E", "N", "D> never"])
    assert f.stopped
    assert "".join(out) == "abc "
    assert out[0] == "abc ", "text before a possible stop is released at once"
    assert out[1] == out[2] == "", "a growing stop prefix is held back"


def test_stop_split_across_one_character_pieces():
    text = "value = 42\n\nnext"
    out, f = feed(["\n\n"], list(text))
    assert f.stopped and "".join(out) == "value = 42"


def test_prefix_of_a_stop_is_held_then_released_when_it_is_not_a_stop():
    f = StopStringFilter(["</s>"])
    f.add("a </")
    assert f.release(final=False) == "a "
    f.add("b")
    assert f.release(final=False) == "</b"
    assert not f.stopped
    f.add(" </s")
    assert f.release(final=False) == " "
    f.add("x>")
    assert f.release(final=False) == "</sx>"
    assert not f.stopped
    assert f.release(final=True) == ""


def test_overlapping_prefix_restarts_inside_the_held_text():
    """'aab' where the held 'aa' fails as 'aaa' but its tail 'aa' may still become the stop."""
    out, f = feed(["aab"], ["x a", "a", "a", "b tail"])
    assert f.stopped
    assert "".join(out) == "x a"


def test_multiple_stops_earliest_wins():
    out, f = feed(["world", "lo"], ["hello world"])
    assert f.stopped and "".join(out) == "hel"
    out, f = feed(["lo", "world"], ["hello world"])
    assert "".join(out) == "hel"


def test_multiple_stops_earliest_wins_across_pieces():
    # Both complete in the same add(): the one that starts first wins.
    out, f = feed(["abcdef", "cd"], ["x ab", "cdef tail"])
    assert f.stopped and "".join(out) == "x "
    # A stop that completes first ends the text, even if a longer one might have matched.
    out, f = feed(["abcdef", "cd"], ["x ab", "c", "d", "ef"])
    assert f.stopped and "".join(out) == "x ab"


def test_multiple_stops_hold_back_the_longest_possible_prefix():
    f = StopStringFilter(["ab", "xyz"])
    f.add("1 x")
    assert f.release(final=False) == "1 "
    f.add("y")
    assert f.release(final=False) == ""
    f.add("a")
    assert f.release(final=False) == "xy"  # 'a' may still start 'ab'
    f.add("c")
    assert f.release(final=False) == "ac"
    assert not f.stopped


def test_release_final_flushes_the_held_tail():
    f = StopStringFilter(["STOP"])
    f.add("the end ST")
    assert f.release(final=False) == "the end "
    assert f.release(final=True) == "ST"
    assert f.release(final=True) == ""
    assert not f.stopped


def test_release_is_idempotent_without_new_text():
    f = StopStringFilter(["zz"])
    f.add("abc z")
    assert f.release(final=False) == "abc "
    assert f.release(final=False) == ""
    assert f.release(final=False) == ""


def test_no_stops_releases_everything():
    for stops in ([], [""]):
        f = StopStringFilter(stops)
        pieces = ["a", "b\n", "\n", "<|endoftext|>", "ST"]
        out = []
        for piece in pieces:
            f.add(piece)
            out.append(f.release(final=False))
        assert out == pieces
        assert not f.stopped
        assert f.release(final=True) == ""


def test_text_after_a_stop_is_dropped():
    f = StopStringFilter(["#"])
    f.add("a # b")
    assert f.stopped
    assert f.release(final=False) == "a "
    assert f.release(final=True) == ""


def test_multibyte_stop_string():
    out, f = feed(["— 日本"], ["naïve café —", " 日", "本語"])
    assert f.stopped and "".join(out) == "naïve café "


# --- detokenizer into stop filter, as the router uses them -----------------------------------

@pytest.mark.parametrize("stop", ["日本語", "\n\n", "café", "self.pos"])
def test_detokenized_stream_cut_at_stop(tokenizer, stop):
    text = MULTIBYTE + "\n\n" + ASCII_CODE
    ids = tokenizer.encode(text)
    detok, f, released = IncrementalDetokenizer(tokenizer), StopStringFilter([stop]), ""
    for token_id in ids:
        f.add(detok.push(token_id))
        released += f.release(final=False)
        assert REPLACEMENT not in released
        if f.stopped:
            break
    else:
        f.add(detok.flush())
    released += f.release(final=True)
    assert f.stopped
    assert released == text[:text.index(stop)]


def test_a_kept_stop_string_stays_in_the_text_and_is_named():
    f = StopStringFilter(["<END>", "zz"], keep=True)
    f.add("abc <EN")
    f.add("D> never")
    assert f.stopped and f.hit == "<END>"
    assert f.release(final=True) == "abc <END>"


def test_text_added_unchecked_is_not_searched_later():
    """min_tokens: a stop string wholly inside the text before min_tokens does not end it
    afterwards (vLLM looks at the new text only); one completed afterwards does."""
    f = StopStringFilter(["ab"])
    f.add("xab", check=False)
    assert not f.stopped
    f.add("c")
    assert not f.stopped
    f.add("ab!")
    assert f.stopped and f.release(final=True) == "xabc"
