"""A request's output constraint, from whichever of its spellings it used, as one llguidance
grammar (replicas/grammar.py applies it), checked against the tokenizer before admission.

Spellings (one per request; two are a 400):
- OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} ({"type": "text"} constrains nothing).
- vLLM: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"}, and the
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

JSON is compact by default (no whitespace between tokens): a grammar that lets any whitespace
through lets a small model wander in it (vLLM 0.32 on CPU answered a two-key schema with `{`
and 60 tokens of blanks). `structured_outputs.disable_any_whitespace: false` allows it.
A `choice` is one of the strings exactly; a `grammar` is GBNF (llama.cpp's) or Lark.
"""

from __future__ import annotations

import json
from functools import lru_cache

from router.errors import bad_request
from router.openai_protocol import _GenerationBody


class GrammarCompiler:
    """Request fields -> a grammar (or None), every error a 400 naming its field."""

    def __init__(self, hf_tokenizer, max_chars: int):
        self._hf_tokenizer = hf_tokenizer
        self.max_chars = max_chars     # limits.max_grammar_chars

    def grammar(self, body: _GenerationBody) -> str | None:
        constraint = _constraint(body)
        if constraint is None:
            return None
        param, kind, value, compact = constraint
        text = _canonical(value)
        self._check_size(len(text), param)
        try:
            grammar = _grammar(kind, text, compact)
        except ValueError as exc:
            raise bad_request(f"Invalid {param}: {exc}", param) from None
        error = self._validate(grammar)
        if error:
            raise bad_request(f"Invalid {param}: {error}", param)
        return grammar

    def tools(self, body) -> str | None:
        """The grammar of a chat request's tool choice (router/tool_calls.py), checked likewise."""
        from router.tool_calls import tool_grammar
        if body.tools:
            self._check_size(sum(len(json.dumps(tool.function.parameters or {})) for tool in body.tools), "tools")
        grammar = tool_grammar(body)
        if grammar is None:
            return None
        error = self._validate(grammar)
        if error:
            raise bad_request(f"Invalid tools: {error}", "tools")
        return grammar

    def _check_size(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise bad_request(f"{param} is {chars} characters; this server compiles at most {self.max_chars} "
                              f"(limits.max_grammar_chars).", param)

    def _validate(self, grammar: str) -> str:
        return _validated(grammar, ll_tokenizer(self._hf_tokenizer))


_LL_TOKENIZERS: dict[int, object] = {}


def ll_tokenizer(hf_tokenizer):
    """llguidance's tokenizer for a Hugging Face one, built once (about 1 s for 128 k tokens)."""
    import llguidance.hf
    if id(hf_tokenizer) not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[id(hf_tokenizer)] = llguidance.hf.from_tokenizer(hf_tokenizer)
    return _LL_TOKENIZERS[id(hf_tokenizer)]


@lru_cache(maxsize=256)
def _validated(grammar: str, tokenizer) -> str:
    import llguidance
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer)


def _constraint(body: _GenerationBody) -> tuple[str, str, object, bool] | None:
    """(the field named in errors, kind, value, compact JSON) of the request's one constraint."""
    found = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", "json", {"type": "object"}, True))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required for type json_schema",
                              "response_format.json_schema")
        found.append(("response_format.json_schema.schema", "json", spec.schema_, True))
    outputs = body.structured_outputs
    if outputs is not None:
        compact = outputs.disable_any_whitespace
        for kind, value in (("json", outputs.json_), ("regex", outputs.regex), ("choice", outputs.choice),
                            ("grammar", outputs.grammar)):
            if value is not None:
                found.append((f"structured_outputs.{kind}", kind, value, compact))
        if outputs.json_object:
            found.append(("structured_outputs.json_object", "json", {"type": "object"}, compact))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", kind, value, True))
    if len(found) > 1:
        raise bad_request(f"At most one output constraint a request; this one has {', '.join(f[0] for f in found)}.",
                          found[1][0])
    return found[0] if found else None


def _canonical(value):
    """Lists and dicts as JSON text: hashable, so that compiled grammars are cached by it."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


@lru_cache(maxsize=256)
def _grammar(kind: str, value: str, compact: bool) -> str:
    import llguidance
    if kind == "json":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = json.loads(value) if value.startswith("[") else None
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice is a list of one or more non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        lark = any_to_lark(value)
    except Exception as exc:  # noqa: BLE001 - the converter's errors are the user's grammar's
        raise ValueError(f"not a GBNF or Lark grammar: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)
