"""The HTTP ingress: OpenAI-compatible endpoints on a Ray Serve deployment.

No `from __future__ import annotations` here: FastAPI reads the handlers' annotations
(`request: Request`) at route creation, and Serve pickles this class by value.
"""

import logging
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoConfig, GenerationConfig

from cluster.config import ClusterConfig
from replicas.loading import load_tokenizer
from router.admission import Admission
from router.errors import OpenAIError, server_error
from router.openai_protocol import ChatBody, CompletionBody, _GenerationBody, parse_body
from router.responses import CHAT, COMPLETION, ResponseFormat, envelope, sse, usage
from router.routing import lane_count
from router.speculation import Generation, SpeculationLoop, SpeculationStats

logger = logging.getLogger("ray.serve")
app = FastAPI(title="specserve")


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return OpenAIError(exc.status_code, str(exc.detail), type=kind).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return OpenAIError(400, str(exc.errors()[0].get("msg", exc))).response()


@app.exception_handler(Exception)
async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed")
    return server_error(f"internal error: {type(exc).__name__}").response()


# Helpers come before the deployment class: Serve pickles it when the decorator runs.
def _eos_ids(config: ClusterConfig, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(config.models.target.path, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def _vocab_size(config: ClusterConfig) -> int:
    return AutoConfig.from_pretrained(config.models.target.path, local_files_only=True).vocab_size


@serve.deployment(name="router")
@serve.ingress(app)
class Router:
    def __init__(self, draft, target, config: ClusterConfig):
        self.config = config
        tokenizer = load_tokenizer(config.models.target.path)
        vocab_size = _vocab_size(config)
        self.admission = Admission(config, tokenizer, vocab_size)
        self.loop = SpeculationLoop(draft, target, tokenizer, _eos_ids(config, tokenizer),
                                    lane_count(config.pools), config.pools.router.gather_wait_ms / 1000)

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        entry = {"id": self.config.server.model_name, "object": "model", "created": 0,
                 "owned_by": "specserve", "max_model_len": self.config.limits.context_length}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, CompletionBody, self.admission.completion, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, ChatBody, self.admission.chat, CHAT)

    async def _generate(self, request: Request, body_type: type[_GenerationBody],
                        admit: Callable[..., Generation], fmt: ResponseFormat):
        body = parse_body(body_type, await request.body())
        gen = admit(body)
        if body.stream:
            return StreamingResponse(self._stream(gen, body, fmt), media_type="text/event-stream")
        return await self._complete(gen, body, fmt)

    async def _complete(self, gen: Generation, body: _GenerationBody, fmt: ResponseFormat) -> dict:
        response_id, stats, text, ids, finish = fmt.new_id(), SpeculationStats(), [], [], None
        async for delta in self.loop.run(gen, stats, seq_id=response_id):
            text.append(delta.text)
            ids.extend(delta.token_ids)
            finish = delta.finish_reason
        choice = fmt.choice("".join(text), finish, ids if body.return_token_ids else None)
        return envelope(fmt.object, response_id, body.model, [choice],
                        usage=usage(len(gen.prompt_ids), len(ids)), speculation=stats.as_dict())

    async def _stream(self, gen: Generation, body: _GenerationBody,
                      fmt: ResponseFormat) -> AsyncIterator[str]:
        response_id, stats, produced, first = fmt.new_id(), SpeculationStats(), 0, True
        want_ids = body.return_token_ids
        try:
            async for delta in self.loop.run(gen, stats, seq_id=response_id):
                produced += len(delta.token_ids)
                if not (delta.text or delta.finish_reason or first or want_ids):
                    continue  # nothing a client could see yet (e.g. half a character)
                choice = fmt.chunk_choice(delta.text, delta.finish_reason, first,
                                          delta.token_ids if want_ids else None)
                extra = {"speculation": stats.as_dict()} if delta.finish_reason else {}
                yield sse(envelope(fmt.chunk_object, response_id, body.model, [choice], **extra))
                first = False
            if body.stream_options and body.stream_options.include_usage:
                yield sse(envelope(fmt.chunk_object, response_id, body.model, [],
                                   usage=usage(len(gen.prompt_ids), produced),
                                   speculation=stats.as_dict()))
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
            logger.exception("stream failed")
            yield sse(server_error(f"generation failed: {type(exc).__name__}").body())
        yield sse("[DONE]")
