"""Drafts a grammar makes for free: the router follows a constrained sequence's output with
the grammar's matcher (llguidance, on the router's tokenizer) and
- where the grammar allows one continuation only (a key, a brace, the rest of an enum value
  once it is unique), drafts it itself: no draft call, and the target keeps it (its masked
  distribution puts all its mass there);
- cuts lookup drafts at the first token the grammar forbids: the target would reject it, and
  the positions after it would be computed for nothing.

Exactness is the verify's, as for any draft: these tokens go through the target's masked
rule like lookup drafts (q one-hot). A forced byte string may have more than one
tokenization the grammar allows; the matcher proposes one, and where the target picks
another the draft is rejected and the target's token taken.
"""

from __future__ import annotations

from router.structured_outputs import ll_tokenizer

FORCED = "forced"              # the draft source's name in stats and metrics
MAX_FORCED = 16                # forced drafts in one window: positions cost the verify pass


class GrammarFollower:
    """One sequence's matcher, advanced by its output as it is emitted."""

    def __init__(self, tokenizer, grammar: str):
        import llguidance
        self._matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)

    def advance(self, tokens: list[int]) -> None:
        if tokens and not self._matcher.is_error():
            self._matcher.consume_tokens(tokens)

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next, at most `limit` (none once it errs or ends)."""
        if limit <= 0 or self._matcher.is_error() or self._matcher.is_stopped():
            return []
        return self._matcher.compute_ff_tokens()[:min(limit, MAX_FORCED)]

    def allowed_prefix(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the grammar forbids."""
        if not drafts or self._matcher.is_error():
            return list(drafts)
        return list(drafts[:self._matcher.validate_tokens(list(drafts))])
