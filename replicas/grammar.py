"""Structured outputs: a request's grammar as a mask over every row of a window, so that the
target's distribution at each position is the masked one (and the draft's too).

The grammar library is llguidance (docs/API.md, "Structured outputs", says why): a grammar is
llguidance's own grammar text (router/structured_outputs.py makes it from a JSON schema, a
regex, a choice or a GBNF/Lark grammar), a matcher follows one sequence's output token by
token and says which tokens may come next.

Terms (one sequence, as in replicas/logits_processing.py):
- output: the tokens after the prompt, before the window.
- window: the drafts d_1..d_(n-1) after the output; row j's context ends with d_1..d_j.
- mask row j: the tokens the grammar allows after output + d_1..d_j.

Row j needs the matcher advanced over d_1..d_j. A draft the grammar forbids is never kept
(its masked probability is 0, and a greedy row's argmax is an allowed token), so the rows
after it are never read: they repeat its row's mask rather than fail. Once the grammar is
complete the mask allows the end of text alone; a request with ignore_eos then gets end of
text until max_tokens (the grammar allows nothing else).

Matchers are kept between calls keyed by the tokens they consumed: a sequence's next call
finds the matcher at its output so far and advances it by what was accepted since, instead
of replaying the whole output.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

_CACHED_MATCHERS = 256


class GrammarMasks:
    """The masks of one model's vocabulary; one per engine."""

    def __init__(self, tokenizer_path: Path | str):
        self._tokenizer_path = tokenizer_path
        self._tokenizer = None       # built on the first grammar: about 1 s for a large vocabulary
        # per grammar, its matchers by the tokens they consumed (least recently used first);
        # grouped so that a lookup compares no grammar text, which may run to kilobytes
        self._matchers: dict[str, OrderedDict[tuple[int, ...], object]] = {}
        self._cached = 0

    def rows(self, grammar: str, output: list[int], window: list[int], vocab: int, device) -> torch.Tensor:
        """Allowed tokens [n, vocab] (bool) of rows 0..n-1, n = len(window) + 1."""
        import llguidance.torch
        matcher = self._matcher_at(grammar, output)
        bits = llguidance.torch.allocate_token_bitmask(len(window) + 1, self._tokenizer.vocab_size)
        consumed = 0
        for j in range(len(window) + 1):
            if matcher.is_stopped() or matcher.is_error():
                bits[j:] = self._end_only()
                break
            llguidance.torch.fill_next_token_bitmask(matcher, bits, j)
            if j < len(window):
                if not _allows(bits[j], window[j]):
                    # d_(j+1) is forbidden: it is rejected at row j, later rows are never read.
                    # (Consuming it would leave the matcher in an error state for good.)
                    bits[j + 1:] = bits[j]
                    break
                matcher.consume_token(window[j])
                consumed += 1
        if consumed and not matcher.is_error():
            matcher.rollback(consumed)
        self._keep(grammar, output, matcher)
        return _unpack(bits, vocab).to(device)

    def _matcher_at(self, grammar: str, output: list[int]):
        """A matcher that consumed `output`, from the cached one that consumed the longest
        prefix of it (or a new one)."""
        cached = self._matchers.get(grammar, {})
        best, best_len = None, -1
        for consumed in cached:
            if best_len < len(consumed) <= len(output) and tuple(output[:len(consumed)]) == consumed:
                best, best_len = consumed, len(consumed)
        if best is not None:
            matcher = cached.pop(best)
            self._cached -= 1
            if not cached:
                del self._matchers[grammar]
        else:
            matcher = self._new_matcher(grammar)
        rest = output[max(best_len, 0):]
        if rest and not matcher.is_error():
            matcher.consume_tokens(rest)
        return matcher

    def _new_matcher(self, grammar: str):
        import llguidance
        import llguidance.hf
        if self._tokenizer is None:
            from replicas.tokenizer import load_tokenizer
            self._tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(self._tokenizer_path))
        return llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)

    def _keep(self, grammar: str, output: list[int], matcher) -> None:
        cached = self._matchers.setdefault(grammar, OrderedDict())
        self._cached += tuple(output) not in cached
        cached[tuple(output)] = matcher
        while self._cached > _CACHED_MATCHERS:   # the oldest grammar's oldest matcher goes
            oldest = next(iter(self._matchers))
            self._matchers[oldest].popitem(last=False)
            self._cached -= 1
            if not self._matchers[oldest]:
                del self._matchers[oldest]

    def _end_only(self) -> torch.Tensor:
        row = torch.zeros((self._tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        eos = self._tokenizer.eos_token
        bit = 1 << (eos % 32)
        row[eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit   # int32's sign bit
        return row


def _allows(row: torch.Tensor, token: int) -> bool:
    return 0 <= token < 32 * row.shape[0] and bool((int(row[token // 32]) >> (token % 32)) & 1)


_BIT = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    # Not llguidance.torch.apply_token_bitmask_inplace: it is torch.compile'd (an inductor
    # build at the first constrained request) and masks in place, where rows feed other uses.
    """llguidance's bitmask [n, ceil(V'/32)] int32 -> allowed [n, vocab] bool; tokens past the
    tokenizer's V' are not allowed (a model's rows may be padded past its tokenizer)."""
    allowed = ((bits.to(torch.int64)[:, :, None] & _BIT) != 0).reshape(bits.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
