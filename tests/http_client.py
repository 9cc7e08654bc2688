"""Small HTTP helpers shared by the tests that talk to a served app."""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx


def complete(url: str, prompt: str, **fields) -> dict:
    body = {"model": "specserve", "prompt": prompt, "temperature": 0, "return_token_ids": True, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(url: str, prompt: str, timeout: float = 120, **fields) -> Iterator[dict]:
    """The parsed SSE chunks of a streamed completion; asserts it ends with [DONE]."""
    body = {"model": "specserve", "prompt": prompt, "temperature": 0, "return_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}, **fields}
    done = False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            yield chunk
    assert done, "stream did not end with data: [DONE]"


def reassemble(chunks) -> dict:
    """Streamed chunks in the non-streaming response shape."""
    text, ids, finish, usage, speculation = "", [], None, None, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["text"]
            ids += choice["token_ids"]
            finish = choice["finish_reason"] or finish
        usage = chunk.get("usage") or usage
        speculation = chunk.get("speculation") or speculation
    return {"choices": [{"text": text, "token_ids": ids, "finish_reason": finish}],
            "usage": usage, "speculation": speculation}


def stream_complete(url: str, prompt: str, **fields) -> dict:
    return reassemble(stream_chunks(url, prompt, **fields))


def wait_for_the_draft_pool(url: str, timeout_s: float = 180) -> None:
    """A deployment or job is ready once the target answers; the draft pool's replicas may still
    be loading (until they answer, the router serves the target alone, router/readiness.py).
    /ready names the pools that have answered."""
    deadline = time.monotonic() + timeout_s
    pools: dict = {}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{url}/ready", timeout=10)
        pools = answer.json().get("pools", {}) if answer.status_code == 200 else {}
        if pools.get("draft"):
            return
        time.sleep(1)
    raise AssertionError(f"the draft pool never answered the router within {timeout_s} s: {pools}")
