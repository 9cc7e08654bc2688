"""Tool calls with the `openai` client on a served app with a draft pool: `tool_choice`
required and named always give valid calls (arguments validate against the function's
schema), greedy and sampled, speculating by every method; a streamed call assembles; the
tool's answer goes back and a final message comes. `auto` is checked on the grammar itself
with llguidance (the tiny random model never starts a call on its own)."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest
from openai import OpenAI

from router.openai_protocol import ChatBody
from router.tool_calls import ToolCallStream, tool_calls, tool_grammar
from tests.conftest import cluster_config, deploy

MODEL = "specserve"
METHODS = ["draft_model", "ngram", "suffix", "hybrid"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is 2 + 3, and the weather in Oslo?"}]
SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}


@pytest.fixture(scope="module")
def client(ray_serve, zoo) -> OpenAI:
    config = cluster_config(zoo.target, zoo.drafts["perturbed"],
                            speculation={"methods": METHODS, "method": "draft_model"},
                            limits={"max_tokens": 400, "context_length": 1024})
    url = deploy(ray_serve, "tools", config)
    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)


def valid_calls(message, names=tuple(SCHEMAS)) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


@pytest.mark.parametrize("setting", sorted(SAMPLING))
@pytest.mark.parametrize("method", METHODS)
def test_required_and_named_choices_always_give_valid_calls(client, method, setting):
    speculation = {"speculation": {"method": method}}
    required = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, extra_body=speculation, **SAMPLING[setting])
    assert required.choices[0].finish_reason == "tool_calls", required.choices[0].message.content
    valid_calls(required.choices[0].message)
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=300, extra_body=speculation,
                                            **SAMPLING[setting])
    assert len(valid_calls(single.choices[0].message)) == 1
    named = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300, extra_body=speculation,
        tool_choice={"type": "function", "function": {"name": "add"}}, **SAMPLING[setting])
    assert [call.function.name for call in valid_calls(named.choices[0].message, ("add",))] == ["add"]


@pytest.mark.parametrize("speculation", [{"method": "draft_model"}, {"enabled": False}])
def test_a_streamed_call_assembles_and_the_loop_ends_with_a_message(client, speculation):
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0, extra_body={"speculation": speculation}) as stream:
        pieces = [event.arguments_delta for event in stream if event.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    [call] = valid_calls(final.choices[0].message, ("get_weather",))
    # the call's name came in a chunk of its own before its arguments (how the arguments split
    # depends on how many tokens each step brings: test_a_streamed_choice_gives_the_same_...)
    assert pieces[0] == "" and len(pieces) >= 2 and "".join(pieces) == call.function.arguments, pieces
    assert final.choices[0].finish_reason == "tool_calls"
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 7})}]
    answer = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)


@pytest.mark.parametrize("method", METHODS)
def test_auto_answers_text_or_valid_calls(client, method):
    for setting in SAMPLING.values():
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                                extra_body={"speculation": {"method": method}}, **setting)
        message = answer.choices[0].message
        if message.tool_calls:
            valid_calls(message)
            assert answer.choices[0].finish_reason == "tool_calls"
        else:
            assert isinstance(message.content, str) and answer.choices[0].finish_reason in ("stop", "length")


def test_auto_allows_text_then_constrains_a_started_call():
    import llguidance
    import llguidance.hf
    from replicas.tokenizer import load_tokenizer

    hf = load_tokenizer("models/target")
    tokenizer = llguidance.hf.from_tokenizer(hf)
    body = ChatBody.model_validate({"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    matcher = llguidance.LLMatcher(tokenizer, tool_grammar(body))
    good = 'Let me see. <tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
    tokens = hf.encode(good, add_special_tokens=False)
    assert matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()
    for bad in ('Hi <tool_call>{"name":"subtract"', 'Hi <tool_call>{"name":"add","arguments":{"a":12'):
        tokens = hf.encode(bad, add_special_tokens=False)
        assert llguidance.LLMatcher(tokenizer, tool_grammar(body)).try_consume_tokens(tokens) < len(tokens), bad
    text, calls = tool_calls(good)
    assert text == "Let me see." and json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["y" * 70_000]}}}]}, "tools"),
])
def test_bad_tools_are_a_400_naming_the_field(client, body, param):
    response = httpx.post(f"{client.base_url}chat/completions", timeout=60,
                          json={"model": MODEL, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def assembled(text: str, seed: int) -> tuple[str, list[tuple[str, str]], int]:
    """(content, [(name, arguments)], calls closed) of text streamed in random pieces through
    ToolCallStream, assembled by index as the `openai` client does."""
    stream, rng, deltas, at = ToolCallStream(), random.Random(seed), [], 0
    while at < len(text):
        size = rng.randint(1, 9)
        deltas += stream.feed(text[at:at + size])
        at += size
    deltas += stream.feed("", final=True)
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in calls and piece["id"].startswith("call_")
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], stream.closed


@pytest.mark.parametrize("seed", range(20))
def test_a_streamed_choice_gives_the_same_content_and_calls_as_the_whole_text(seed):
    """Whatever the pieces: text around calls is content (a `<tool_call>` never leaks half into
    it), braces inside arguments are not taken for the call's end, a call whose keys come in
    another order is sent whole, and a call cut off (max_tokens) sends what it had."""
    text = ('Let me see. <tool_call>{"name":"add","arguments":{"a":1,"b":{"c":"}"}}}</tool_call> then '
            '<tool_call>{"arguments":{"city":"Oslo"},"name":"get_weather"}</tool_call> <b> '
            '<tool_call>{"name":"add","arguments":{"a":')
    content, calls, closed = assembled(text, seed)
    assert content == "Let me see.  then  <b> "
    assert calls == [("add", '{"a":1,"b":{"c":"}"}}'), ("get_weather", '{"city":"Oslo"}'), ("add", '{"a":')]
    assert closed == 2
    whole_content, whole_calls = tool_calls(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == calls[:2]
    free = "text with <tool_call>not a call</tool_call>"
    assert assembled(free, seed) == (free, [], 0)
