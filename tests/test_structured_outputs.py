"""Structured outputs through HTTP with the `openai` client, on a served app with a draft
pool: JSON schemas of a dozen shapes, a Pydantic model through `chat.completions.parse`,
`choice`, `regex` and a GBNF grammar, in OpenAI's and vLLM's spellings, greedy and sampled,
every draft method, in batches beside unconstrained requests; every output parses and
validates (jsonschema). Bad constraints get a 400 naming their field.

The test models are tiny and random: what they write inside the grammar is noise, so every
string and array here is bounded, or a request could end at max_tokens mid-structure.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.conftest import cluster_config, deploy

MODEL = "specserve"
MAX_TOKENS = 160
METHODS = ["draft_model", "ngram", "suffix", "hybrid"]
NAME = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": NAME},
        "required": ["id", "name"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
             "required": ["colour"], "additionalProperties": False},
    "bounded_integer": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
                        "required": ["n"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                 "required": ["a"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [NAME, {"type": "integer", "minimum": 0, "maximum": 9}]}},
               "required": ["v"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "event"}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"], "additionalProperties": False},
    "objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": NAME}, "required": ["k"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,4}$"}},
                "required": ["code"], "additionalProperties": False},
    "boolean_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
}
SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}


@pytest.fixture(scope="module")
def url(ray_serve, zoo) -> str:
    config = cluster_config(zoo.target, zoo.drafts["perturbed"],
                            speculation={"methods": METHODS, "method": "draft_model"})
    return deploy(ray_serve, "structured", config)


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)


def chat(client: OpenAI, extra: dict, **fields) -> str:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=MAX_TOKENS,
        extra_body=extra, **fields)
    choice = response.choices[0]
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    return choice.message.content


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("method", METHODS)
def test_every_schema_validates_greedy_and_sampled_in_a_batch_beside_free_requests(client, method):
    speculation = {"speculation": {"method": method}}
    jobs = [(name, setting) for name in SCHEMAS for setting in SAMPLING]
    with ThreadPoolExecutor(len(jobs) + 4) as pool:
        free = [pool.submit(client.completions.create, model=MODEL, prompt=f"def f{i}(x):\n", max_tokens=24,
                            extra_body=speculation) for i in range(4)]
        outputs = {job: pool.submit(chat, client, speculation, response_format=json_schema_format(job[0]),
                                    **SAMPLING[job[1]]) for job in jobs}
        for job, future in outputs.items():
            jsonschema.validate(json.loads(future.result()), SCHEMAS[job[0]])
        assert all(len(f.result().choices[0].text) > 0 for f in free)


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)
    label: str = Field(max_length=5)


@pytest.mark.parametrize("setting", sorted(SAMPLING))
def test_parse_with_a_pydantic_model(client, setting):
    response = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A point."}], response_format=Point,
        max_tokens=MAX_TOKENS, **SAMPLING[setting])
    assert isinstance(response.choices[0].message.parsed, Point)


@pytest.mark.parametrize("setting", sorted(SAMPLING))
def test_choice_regex_and_gbnf_in_both_spellings(client, setting):
    choices = ["alpha", "beta", "gamma"]
    gbnf = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-c] [0-9]'
    cases = [({"structured_outputs": {"choice": choices}}, lambda text: text in choices),
             ({"guided_choice": choices}, lambda text: text in choices),
             ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
             ({"guided_regex": "x[0-9]+y"}, lambda text: re.fullmatch("x[0-9]+y", text)),
             ({"structured_outputs": {"grammar": gbnf}}, lambda t: re.fullmatch(r"\([a-c][0-9](,[a-c][0-9])?\)", t)),
             ({"guided_json": SCHEMAS["flat"]}, lambda text: jsonschema.validate(json.loads(text), SCHEMAS["flat"])
              or True),
             ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict))]
    for extra, valid in cases:
        if "response_format" in extra and setting == "sampled":
            continue   # any JSON object: a random model's sampled keys may run past max_tokens (seen in CI)
        for speculation in ({"method": "suffix"}, {"method": "draft_model"}, {"enabled": False}):
            text = chat(client, {**extra, "speculation": speculation}, **SAMPLING[setting])
            assert valid(text), (extra, speculation, text)


def test_greedy_structured_output_is_the_same_with_and_without_speculation(client):
    for name in ("nested", "ref", "objects"):
        alone = chat(client, {"speculation": {"enabled": False}}, response_format=json_schema_format(name), temperature=0)
        for method in METHODS:
            for k in (1, 3, 5):
                assert chat(client, {"speculation": {"method": method, "k": k}}, temperature=0,
                            response_format=json_schema_format(name)) == alone, (method, k)


def test_completions_take_a_constraint_too(client):
    text = client.completions.create(model=MODEL, prompt="x = ", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{1,3}"}}).choices[0].text
    assert re.fullmatch("[0-9]{1,3}", text), text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["y" * 70_000]}}}},
     "response_format.json_schema.schema"),        # over limits.max_grammar_chars (65536 by default)
    ({"guided_grammar": 'root ::= "a"' + " | \"a\"" * 20_000}, "guided_grammar"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(url, body, param):
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("method", METHODS)
def test_tokens_the_grammar_forces_are_drafted_by_the_router_and_counted(url, method):
    """Keys, braces and the rest of a unique enum value cost no draft call; greedy output is
    the target alone's under the same schema."""
    def ask(speculation: dict) -> dict:
        response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "response_format": json_schema_format("ref"), "speculation": speculation})
        assert response.status_code == 200, response.text
        return response.json()
    alone, speculating = ask({"enabled": False}), ask({"method": method})
    assert speculating["choices"][0]["message"] == alone["choices"][0]["message"]
    forced = speculating["speculation"]["by_kind"]["forced"]
    # {"start":{"x": ... "end":{"x": ... : every key and brace is forced
    assert speculating["speculation"]["forced_tokens"] == forced["accepted_tokens"] >= 10, speculating["speculation"]
    assert alone["speculation"]["forced_tokens"] == 0
