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
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


def render_tools(tools) -> str:
    """The tools as the plain chat template shows them (a tokenizer without a template of its own)."""
    specs = [{"name": t.function.name, "description": t.function.description or "",
              "parameters": t.function.parameters or _ANY_OBJECT} for t in tools]
    return ("tools: " + json.dumps(specs, separators=(",", ":")) + "\n"
            f'To call one, write {OPEN}{{"name":...,"arguments":{{...}}}}{CLOSE}\n')


def render_call(call) -> str:
    """An assistant message's earlier call, as the model would have written it."""
    return f'{OPEN}{{"name":{json.dumps(call.function.name)},"arguments":{call.function.arguments}}}{CLOSE}'
