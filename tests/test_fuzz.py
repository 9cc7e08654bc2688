"""Schema-driven fuzzing of both generation endpoints (hypothesis): bodies mix well-formed
fields, edge values and junk of every JSON type (NaN and Infinity included). Every answer
must be a 2xx whose stream carries no error event, or a 4xx with a well-formed OpenAI error
body; never a 5xx. Afterwards the server still serves. Bounded and derandomized, so CI runs
the same examples every time; FUZZ_EXAMPLES=1000 runs more."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "specserve"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


def either(good):
    """Mostly plausible values, sometimes junk."""
    return st.one_of(good, good, good, junk)


small_floats = st.floats(min_value=-1, max_value=3) | st.sampled_from([0.0, 1e-300, 5e-324, 1e-45, 1e-5, 2.0])
COMMON = {
    "model": either(st.sampled_from([MODEL, MODEL, "gpt-4o", ""])),
    "max_tokens": either(st.integers(-1, 6) | st.sampled_from([256, 257, 10 ** 12])),
    "temperature": either(small_floats | st.floats()),
    "top_p": either(small_floats),
    "top_k": either(st.integers(-2, 600)),
    "seed": either(st.integers()),
    "stop": either(st.text(max_size=300) | st.lists(st.text(max_size=12), max_size=10)),
    "n": either(st.integers(0, 3)),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({}, optional={"include_usage": either(st.booleans())})),
    "speculation": either(st.fixed_dictionaries({}, optional={"enabled": either(st.booleans()),
                                                             "k": either(st.integers(-1, 20))})),
    "return_token_ids": either(st.booleans()),
    "user": either(st.text(max_size=20)),
    "frequency_penalty": either(small_floats),
    "presence_penalty": either(small_floats),
    "logprobs": junk,
    "unknown_field": junk,
    # structured outputs: schemas, regexes and grammars the library must refuse cleanly
    "response_format": either(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                                    optional={"json_schema": st.fixed_dictionaries(
                                                        {"name": st.text(max_size=5)},
                                                        optional={"schema": junk | st.fixed_dictionaries(
                                                            {"type": st.sampled_from(["object", "string", "x"])},
                                                            optional={"maxLength": junk, "enum": junk})})})),
    "structured_outputs": either(st.fixed_dictionaries({}, optional={
        "regex": st.text(max_size=12), "choice": st.lists(st.text(max_size=5), max_size=3),
        "grammar": st.text(max_size=30) | st.just('root ::= "a" [0-9]'), "json": junk})),
}
PROMPT = st.text(max_size=200) | st.lists(st.integers(-3, 700), max_size=40) \
    | st.lists(st.text(max_size=20), max_size=2) | st.lists(st.lists(st.integers(0, 600), max_size=8), max_size=2)
MESSAGE = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
     "content": either(st.text(max_size=100) | st.lists(st.fixed_dictionaries(
         {"type": either(st.just("text")), "text": either(st.text(max_size=30))}), max_size=3))},
    optional={"name": either(st.text(max_size=10))})

BODIES = {
    "/v1/completions": st.fixed_dictionaries({}, optional={
        **COMMON, "prompt": either(PROMPT), "echo": either(st.booleans()), "best_of": either(st.integers(0, 2))}),
    "/v1/chat/completions": st.fixed_dictionaries({}, optional={
        **COMMON, "messages": either(st.lists(MESSAGE, max_size=3)),
        "max_completion_tokens": either(st.integers(-1, 6)),
        "tools": either(st.lists(st.fixed_dictionaries({"type": either(st.just("function")), "function": either(
            st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"])},
                                  optional={"parameters": junk}))}), max_size=2)),
        "tool_choice": either(st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})}))}),
}


def check_answer(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    assert status < 500, response.text
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        return
    assert 200 <= status < 300
    if not streamed:
        assert response.json()["choices"]
        return
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    assert all("error" not in json.loads(event) for event in events[:-1]), events


@pytest.mark.parametrize("path", list(BODIES))
def test_fuzzed_bodies_get_2xx_or_well_formed_4xx(apps, path):
    url = apps["perturbed"]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=BODIES[path])
    def fuzz(body):
        raw = json.dumps(body).encode()     # NaN and Infinity are written as JSON extensions
        response = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"},
                              timeout=120)
        check_answer(response, streamed=body.get("stream") is True)

    fuzz()
    alive = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert alive.status_code == 200 and httpx.get(f"{url}/health", timeout=60).status_code == 200
