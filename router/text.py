"""From generated token ids to the text a client sees: incremental detokenisation and
stop strings.

Text is released only when it is final: a multi-byte character still being spelled out over
several byte-level tokens (its decoded text ends in U+FFFD) waits, and so does a tail that
could still turn into a stop string. A stop string ends the text just before it (after it,
when the request keeps it: vLLM's include_stop_str_in_output).
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing id list in O(new tokens) per call, by re-decoding a few tokens of
    context before the unread ones (so merges across the boundary come out right)."""

    def __init__(self, tokenizer, context: int = 5, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.context = context
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.read = 0  # ids[:read] are already turned into text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        start = max(0, self.read - self.context)
        known = self._decode(self.ids[start:self.read])
        full = self._decode(self.ids[start:])
        if full.endswith(_INCOMPLETE) or len(full) < len(known):
            return ""
        self.read = len(self.ids)
        return full[len(known):]

    def flush(self) -> str:
        """Whatever is still unread, an unfinished character included (as U+FFFD)."""
        start = max(0, self.read - self.context)
        known = self._decode(self.ids[start:self.read])
        full = self._decode(self.ids[start:])
        self.read = len(self.ids)
        return full[len(known):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class StopStringFilter:
    """Accumulates text; says how much is safe to release and whether a stop string hit."""

    def __init__(self, stops: list[str], keep: bool = False):
        self.stops = [s for s in stops if s]
        self.keep = keep               # the stop string stays in the text
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.released = 0
        self.stopped = False
        self.hit: str | None = None    # the stop string that ended the text

    def add(self, piece: str, check: bool = True) -> None:
        """Append `piece`; unless `check` is false (min_tokens not yet out), look for a stop
        string in the text it completes."""
        search_from = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        if not check:
            return
        hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.hit = min(hits)
            self.text = self.text[:at + (len(self.hit) if self.keep else 0)]
            self.stopped = True

    def release(self, final: bool) -> str:
        """The newly safe text; at the end (`final`) or after a stop, everything left."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_tail()
        piece = self.text[self.released:end]
        self.released = max(self.released, end)
        return piece

    def _held_tail(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for size in range(min(self.longest - 1, len(self.text) - self.released), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0
