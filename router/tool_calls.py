"""Tool calls: the request's `tools` and `tool_choice` as a grammar over what the model writes,
and what it wrote back as OpenAI `tool_calls`.

The model writes a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
Hermes/Qwen convention many chat templates use). By `tool_choice`:
- "none": the model writes text; no grammar.
- "auto" (the default with tools): text, and once the model writes `<tool_call>` the call is
  constrained to a declared function and its parameters' schema (llguidance's structural tags).
- "required": one call or more, up to MAX_PARALLEL_CALLS (exactly one with
  `parallel_tool_calls: false`), nothing else.
- {"type": "function", "function": {"name": N}}: one call of N.
Compact JSON throughout, as for response_format (router/structured_outputs.py).
"""

from __future__ import annotations

import json
import re
import uuid

from router.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_ANY_OBJECT = {"type": "object"}
# "required" with parallel calls: at most this many, or a model that likes calling would call
# until max_tokens (the grammar cannot tell it when to stop).
MAX_PARALLEL_CALLS = 4


def tool_grammar(body) -> str | None:
    """The llguidance grammar of the request's tool choice, or None (no tools, or "none")."""
    import llguidance

    tools, choice = body.tools or [], body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "none":
        return None
    functions = {tool.function.name: _compact(tool.function.parameters or _ANY_OBJECT) for tool in tools}
    if len(functions) < len(tools):
        raise bad_request("tools have one name each; a name repeats", "tools")
    if choice == "auto":
        tags = [llguidance.StructTag(trigger=OPEN, begin=f'{OPEN}{{"name":{json.dumps(name)},"arguments":', grammar=schema,
                          end=f"}}{CLOSE}") for name, schema in functions.items()]
        return llguidance.StructTag.to_grammar(tags, assume_special=False)
    if choice == "required":
        calls = _compact({"anyOf": [_call_schema(name, schema) for name, schema in functions.items()]})
        repeat = " call?" * (MAX_PARALLEL_CALLS - 1) if body.parallel_tool_calls else ""
    else:
        name = choice.function.name
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        calls, repeat = _compact(_call_schema(name, functions[name])), ""
    lark = (f"start: call{repeat}\ncall: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\n"
            f"body: %json {json.dumps(calls)}")
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _compact(schema: dict) -> dict:
    """The schema with llguidance's option for JSON without whitespace between tokens."""
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside calls, or None when there is none; the calls, OpenAI's shape) of an
    output. A call that does not parse (cut by max_tokens) stays in the text."""
    calls = []
    for match in _CALL.finditer(text):
        parsed = _parsed_call(match.group(1))
        if parsed is not None:
            calls.append(_call(*parsed))
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# What a call's body starts with before its arguments; the grammars write it compact.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _parsed_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as the model wrote them) of a call's body, or None if it does not parse."""
    header = _HEADER.match(body)
    if header is not None:
        rest = body[header.end():].rstrip()
        arguments = rest[:-1].rstrip() if rest.endswith("}") else ""
        try:
            json.loads(arguments)
            return json.loads(header.group(1)), arguments
        except ValueError:
            return None
    try:            # the keys in another order: arguments re-serialized
        call = json.loads(body)
        return call["name"], json.dumps(call["arguments"], separators=(",", ":"))
    except (ValueError, KeyError, TypeError):
        return None


class ToolCallStream:
    """A tool-calling choice's text, as it streams, in OpenAI's chat deltas: text outside calls
    as `content` at once (less a tail that may begin `<tool_call>`); a call's id and name once
    its header is written; its arguments as they come, less the tail from their last `}`
    (which may be the call's own closing brace). feed() answers the deltas new text makes."""

    def __init__(self):
        self._text = ""
        self._done = 0              # characters of _text turned into deltas
        self._in_call = False
        self._arguments_at = None   # where the open call's arguments begin, once its header is read
        self.calls = 0              # calls started
        self.closed = 0             # calls whose `</tool_call>` came

    def feed(self, text: str, final: bool = False) -> list[dict]:
        self._text += text
        deltas: list[dict] = []
        while self._step(deltas, final):
            pass
        return deltas

    def _step(self, deltas: list[dict], final: bool) -> bool:
        """Turn what can be turned of the text into deltas; True if a call opened or closed."""
        text, done = self._text, self._done
        if not self._in_call:
            start = text.find(OPEN, done)
            end = start if start >= 0 else len(text) - (0 if final else _partial_tail(text[done:], OPEN))
            if end > done:
                deltas.append({"content": text[done:end]})
            self._done = end
            if start >= 0:
                self._done, self._in_call, self._arguments_at = start + len(OPEN), True, None
            return start >= 0
        close = text.find(CLOSE, done)
        body_end = close if close >= 0 else len(text)
        if self._arguments_at is None and not self._open_call(deltas, text[done:body_end], close >= 0 or final):
            return False
        if self._arguments_at is None:      # closed without a call's header: it stays text
            deltas.append({"content": OPEN + text[done:body_end] + (CLOSE if close >= 0 else "")})
        else:
            end = self._arguments_end(text[:body_end], closed=close >= 0, final=final)
            if end > self._done:
                deltas.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text[self._done:end]}}]})
                self._done = end
        if close < 0 and not final:
            return False
        self._done, self._in_call = (close + len(CLOSE) if close >= 0 else len(text)), False
        self.closed += close >= 0 and self._arguments_at is not None
        return close >= 0

    def _open_call(self, deltas: list[dict], body: str, whole: bool) -> bool:
        """Send the call's id and name once its header is written. False: wait for more text."""
        header = _HEADER.match(body)
        if header is None:
            parsed = _parsed_call(body) if whole else None
            if parsed is None:
                return whole
            self._arguments_at = self._done + len(body)      # sent whole below, nothing to stream
            self.calls += 1
            deltas.append({"tool_calls": [{"index": self.calls - 1, **_call(parsed[0], parsed[1])}]})
            self._done = self._arguments_at
            return True
        call = _call(json.loads(header.group(1)), "")
        deltas.append({"tool_calls": [{"index": self.calls, **call}]})
        self.calls += 1
        self._done = self._arguments_at = self._done + header.end()
        return True

    def _arguments_end(self, text: str, closed: bool, final: bool) -> int:
        """Where the arguments that can be sent end: before the call's closing brace once it
        closed (or at the end of a call cut off), else before the last `}` so far."""
        if closed:
            rest = text.rstrip()
            end = len(rest) - 1 if rest.endswith("}") else len(rest)
            return max(self._done, len(text[:end].rstrip()))
        if final:
            return len(text)
        return max(self._done, text.rfind("}", self._arguments_at))


def _partial_tail(text: str, marker: str) -> int:
    """How many characters at the end of text may be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def render_tools(tools) -> str:
    """The tools as the plain chat template shows them (a tokenizer without a template of its own)."""
    specs = [{"name": t.function.name, "description": t.function.description or "",
              "parameters": t.function.parameters or _ANY_OBJECT} for t in tools]
    return ("tools: " + json.dumps(specs, separators=(",", ":")) + "\n"
            f'To call one, write {OPEN}{{"name":...,"arguments":{{...}}}}{CLOSE}\n')


def render_call(call) -> str:
    """An assistant message's earlier call, as the model would have written it."""
    return f'{OPEN}{{"name":{json.dumps(call.function.name)},"arguments":{call.function.arguments}}}{CLOSE}'
