"""OpenAI response bodies and SSE chunks for the two generation endpoints."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass



@dataclass(frozen=True)
class ResponseFormat:
    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex

    def choice(self, text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool,
                     token_ids: list[int] | None) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if first else
                               ({"content": text} if text or finish_reason is None else {}))
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice


COMPLETION = ResponseFormat("text_completion", "text_completion", "cmpl-", chat=False)
CHAT = ResponseFormat("chat.completion", "chat.completion.chunk", "chatcmpl-", chat=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(fmt_object: str, response_id: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": response_id, "object": fmt_object, "created": int(time.time()), "model": model,
            "choices": choices, **extra}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
