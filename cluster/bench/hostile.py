"""Hostile inputs against a running specserve, and the answer each gets: a markdown table.

    python -m cluster.bench.hostile --url http://127.0.0.1:8000 [--api-key KEY]

Each case is one request; after all of them a plain completion must still succeed. The
table in docs/ROBUSTNESS.md was made by this command on the default cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterator

import httpx

OK = {"model": "specserve", "prompt": "import os\n", "max_tokens": 4}
CHAT_OK = {"model": "specserve", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
C, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def _chunked(total: int) -> Iterator[bytes]:
    yield b'{"model": "specserve", "prompt": "'
    for _ in range(total // 65536):
        yield b"y" * 65536
    yield b'"}'


def cases(model: str) -> list[tuple[str, str, dict]]:
    """(what, path, httpx.post keyword arguments)"""
    ok = {**OK, "model": model}

    def body(**fields):
        return {"content": json.dumps({**ok, **fields}).encode(), "headers": JSON}

    def raw(data: bytes, headers=None):
        return {"content": data, "headers": headers or JSON}

    return [
        ("temperature 1e-300 (once a NaN for its whole batch)", C, body(temperature=1e-300)),
        ("temperature 5e-324 (the smallest double)", C, body(temperature=5e-324)),
        ("top_p 1e-300 (0 in float32: once an empty nucleus)", C, body(temperature=1.0, top_p=1e-300)),
        ("seed 2**200", C, body(temperature=1.0, seed=2 ** 200)),
        ("temperature NaN (a JSON extension)", C, raw(json.dumps({**ok, "temperature": float("nan")}).encode())),
        ("max_tokens 1e400 (overflows a double)", C, raw(b'{"model": "%s", "prompt": "x", "max_tokens": 1e400}' % model.encode())),
        ("max_tokens 10**12", C, body(max_tokens=10 ** 12)),
        ("50 MB body with Content-Length", C, raw(json.dumps({**ok, "prompt": "x" * (50 << 20)}).encode())),
        ("2 MB body, chunked (no Content-Length)", C, {"content": _chunked(2 << 20), "headers": JSON}),
        ("900 KB prompt text (under the body limit)", C, body(prompt="def f():\n" * 100_000)),
        ("prompt of 600 token ids (over the context)", C, body(prompt=[5] * 600)),
        ("prompt token id outside the vocabulary", C, body(prompt=[1, 2, 10 ** 9])),
        ("stop string of 10,000 characters", C, body(stop=["x" * 10_000])),
        ("9 stop strings", C, body(stop=list("abcdefghi"))),
        ("lone surrogate \\ud800 in the prompt", C, raw(b'{"model": "%s", "prompt": "a\\ud800b"}' % model.encode())),
        ("JSON nested 100,000 deep", C, raw(b"[" * 100_000)),
        ("not JSON", C, raw(b"hello")),
        ("a JSON array, not an object", C, raw(b"[1, 2]")),
        ("unknown field", C, body(frobnicate=1)),
        ("n = 2", C, body(n=2)),
        ("logprobs = 5 (not supported)", C, body(logprobs=5)),
        ("chat role 'tool'", CHAT, {"content": json.dumps({**CHAT_OK, "model": model, "messages": [
            {"role": "tool", "content": "x"}]}).encode(), "headers": JSON}),
        ("speculation.k = 10**6", C, body(speculation={"k": 10 ** 6})),
        ("unknown model", C, body(model="gpt-9")),
        ("Content-Type text/plain", C, raw(json.dumps(ok).encode(), {"content-type": "text/plain"})),
        ("form post (what a cross-site page can send)", C,
         raw(b"model=specserve&prompt=x", {"content-type": "application/x-www-form-urlencoded"})),
    ]


def _answer(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        error = None
    if error:
        param = f", param `{error['param']}`" if error.get("param") else ""
        return f"{response.status_code} `{error.get('code') or error.get('type')}`{param}"
    return str(response.status_code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="specserve")
    parser.add_argument("--api-key", help="the server requires keys: send this one, and check one case without it")
    args = parser.parse_args(argv)
    auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    for what, path, kwargs in cases(args.model):
        kwargs = {**kwargs, "headers": {**kwargs["headers"], **auth}}
        rows.append((what, _answer(httpx.post(f"{args.url}{path}", timeout=120, **kwargs))))
    if args.api_key:
        missing = httpx.post(f"{args.url}{C}", json={**OK, "model": args.model}, timeout=120)
        rows.append(("no Authorization header (keys configured)", _answer(missing)))
    alive = httpx.post(f"{args.url}{C}", json={**OK, "model": args.model}, headers=auth, timeout=120)
    print("| input | answer |\n|---|---|")
    for what, answer in rows:
        print(f"| {what} | {answer} |")
    print(f"\nafterwards, a plain completion: {alive.status_code}")
    return 0 if alive.status_code == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
