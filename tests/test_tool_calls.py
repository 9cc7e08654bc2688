"""Tool calls with the `openai` client on a served app with a draft pool: `tool_choice`
required and named always give valid calls (arguments validate against the function's
schema), greedy and sampled, speculating by every method; a streamed call assembles; the
tool's answer goes back and a final message comes. `auto` is checked on the grammar itself
with llguidance (the tiny random model never starts a call on its own)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from router.openai_protocol import ChatBody
from router.tool_calls import tool_calls, tool_grammar
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


def test_a_streamed_call_assembles_and_the_loop_ends_with_a_message(client):
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    [call] = valid_calls(final.choices[0].message, ("get_weather",))
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
