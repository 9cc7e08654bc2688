"""OpenAI response bodies and SSE chunks for the two generation endpoints."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from replicas.protocol import TokenLogprobs

# JSON has no -inf: a logprob below this is sent as this (as vLLM does).
_LOWEST_LOGPROB = -9999.0


@dataclass(frozen=True)
class ResponseFormat:
    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex

    def choice(self, index: int, text: str | None, finish_reason: str | None, stop_reason: int | str | None,
               token_ids: list[int] | None, logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
                     first: bool, token_ids: list[int] | None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if first else
                               ({"content": text} if text or finish_reason is None else {}))
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice


def tool_call_chunk_choices(index: int, deltas: list[dict], first: bool, finish_reason: str | None,
                            stop_reason) -> list[dict]:
    """A tool-calling choice's stream chunks (router/tool_calls.py, ToolCallStream, makes the
    deltas): the role with the first, finish_reason apart in the last."""
    if first:
        deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
    chunks = [{"index": index, "logprobs": None, "finish_reason": None, "delta": delta} for delta in deltas]
    if finish_reason is not None:
        chunks.append({"index": index, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason,
                       "delta": {}})
    return chunks


COMPLETION = ResponseFormat("text_completion", "text_completion", "cmpl-", chat=False)
CHAT = ResponseFormat("chat.completion", "chat.completion.chunk", "chatcmpl-", chat=True)


def _finite(logprob: float) -> float:
    return max(logprob, _LOWEST_LOGPROB)


def completion_logprobs(entries: list[tuple[int, TokenLogprobs | None]], decode: Callable[[int], str],
                        offset: int = 0) -> dict:
    """OpenAI's legacy logprobs object for (token id, its logprobs) pairs, None where a token has
    none (an echoed prompt's first): each token's text, logprob, the most likely with theirs
    (the token itself among them, as OpenAI's legacy completions give it), and text offsets
    from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in entries:
        text = decode(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry.logprob))
        top = {decode(i): _finite(lp) for i, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: list[TokenLogprobs], decode: Callable[[int], str]) -> dict:
    """The chat logprobs object: per token its text, logprob, UTF-8 bytes and the most likely."""
    def item(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(fmt_object: str, response_id: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": response_id, "object": fmt_object, "created": int(time.time()), "model": model,
            "choices": choices, **extra}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
