"""The HTTP ingress: OpenAI-compatible endpoints on a Ray Serve deployment.

A generation request passes, in order: the API key (401), its content type (415), its
declared size (413), this replica's admission gate (429 with Retry-After when it is full;
before the body is read, so that a refusal costs next to nothing), the body's size and schema
(413, 400), the limits of the cluster (400; tokenising and chat templating run off the event
loop), then the speculation loop, under the request's deadline (504, or a final SSE error
event). A failure
of one request's own work fails that request alone (router/speculation.py).

No `from __future__ import annotations` here: FastAPI reads the handlers' annotations
(`request: Request`) at route creation, and Serve pickles this class by value.
"""

import asyncio
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoConfig, GenerationConfig

from cluster.config import ClusterConfig
from replicas.tokenizer import load_tokenizer
from replicas.protocol import RowError, TokenLogprobs
from router.admission import Admission
from router.auth import ApiKeys
from router.choices import ChoiceOutput, best_of, interleaved, prompt_tokens
from router.errors import (OpenAIError, deadline_exceeded, loading, overloaded, payload_too_large, server_error,
                           unavailable, unsupported_media_type)
from router.gate import GateFull, RequestGate, Slot
from router.k_control import GoodputController
from replicas.metrics import GAUGE_REFRESH_S, refresh_every
from replicas.drafting.lookup import LookupOptions
from router.metrics import RouterMetrics
from router.readiness import FIRST_ANSWER_WAIT_S
from router.openai_protocol import ChatBody, CompletionBody, _GenerationBody, parse_body
from router.responses import (CHAT, COMPLETION, ResponseFormat, chat_logprobs, completion_logprobs, envelope, sse,
                              tool_call_chunk_choices, usage)
from router.routing import lane_count
from router.shedding import Shedder, ShedWhenFull, install as install_shedder
from router.pool_client import PoolTimeouts, TargetTimeout, TargetUnavailable
from router.speculation import Delta, Generation, SpeculationLoop, SpeculationStats
from router.tool_calls import ToolCallStream, tool_calls

logger = logging.getLogger("ray.serve")
app = FastAPI(title="specserve")
app.add_middleware(ShedWhenFull)   # a full gate's 429 before FastAPI routes the request (router/shedding.py)
# Tokenising and templating, off the event loop: prompts are bounded (router/admission.py),
# so two threads keep one long prompt from holding up the others' admission.
_TOKENIZER_THREADS = 2


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
        eos = GenerationConfig.from_pretrained(config.models.target.folder, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def _vocab_size(config: ClusterConfig) -> int:
    return AutoConfig.from_pretrained(config.models.target.folder, local_files_only=True).vocab_size


def _require_json(content_type: str | None) -> None:
    """Only application/json starts work: a cross-site form post (which a browser sends
    without asking first) cannot have that type."""
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise unsupported_media_type(content_type)


def _check_declared_size(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is over `limit` bytes (no Content-Length: chunked)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _failure(exc: BaseException) -> OpenAIError:
    """What a client is told when its generation failed after admission."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RowError):
        return server_error(f"generation failed for this request ({exc})")
    if isinstance(exc, TargetTimeout):
        return OpenAIError(504, str(exc), type="server_error", code="timeout")
    if isinstance(exc, TargetUnavailable):
        return unavailable(str(exc))
    return server_error(f"generation failed: {type(exc).__name__}")


async def _until(deadline: float, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The deltas, each awaited until the deadline (time.monotonic()); past it, TimeoutError.
    The generator is closed either way, which releases the sequence's caches."""
    try:
        while True:
            try:
                delta = await asyncio.wait_for(deltas.__anext__(), max(deadline - time.monotonic(), 0))
            except StopAsyncIteration:
                return
            yield delta
    finally:
        await deltas.aclose()


@serve.deployment(name="router")
@serve.ingress(app)
class Router:
    def __init__(self, draft, target, config: ClusterConfig, channel_key: bytes):
        self.config = config
        tokenizer = load_tokenizer(config.models.target.folder)
        vocab_size = _vocab_size(config)
        self.keys = ApiKeys.load(config.server.api_keys_file)
        eos_token_ids = _eos_ids(config, tokenizer)
        self.admission = Admission(config, tokenizer, vocab_size, eos_token_ids)
        pools = config.pools
        self.gate = RequestGate(pools.router.max_ongoing_requests, pools.router.max_queued_requests)
        spec = config.speculation
        self.metrics = RouterMetrics()
        self.loop = SpeculationLoop(draft, target, tokenizer, eos_token_ids,
                                    PoolTimeouts(pools.draft.call_timeout_ms / 1000, pools.target.call_timeout_s),
                                    GoodputController(spec.max_k, spec.min_k, pools.target.decode_steps),
                                    lane_count(pools), pools.router.gather_wait_ms / 1000, self.metrics,
                                    channel_key if pools.router.direct_calls else None,
                                    engine_rounds=pools.target.engine == "vllm",
                                    lookup=LookupOptions(spec.k, spec.hybrid_min_ngram, spec.lookup_fallback),
                                    suffix_cache_tokens=spec.suffix_cache_tokens if "suffix" in spec.methods else 0)
        self._tokenizer_threads = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._shed_count = self._shed_counted = 0
        install_shedder(Shedder(lambda: self.gate.admits, self.keys.authorized, self._shed,
                                pools.router.retry_after_s))
        refresh_every(GAUGE_REFRESH_S, self._refresh_gauges)
        try:       # probing the pools from the start, where the constructor runs on the replica's loop
            asyncio.get_running_loop()
            self.loop.readiness.watch()
        except RuntimeError:
            pass   # else from the first request or probe
        logger.info("router ready; API keys %s", "required" if self.keys.required else "not required")

    def _shed(self) -> None:
        """A request refused before the endpoint: counted in the metrics with the next gauge
        refresh, not at once (a tagged counter's record is a fair share of a refusal's cost)."""
        self.gate.refuse()
        self._shed_count += 1      # on the event loop; read by the gauges' thread, which keeps its own count

    def _refresh_gauges(self) -> None:
        shed = self._shed_count
        if shed > self._shed_counted:
            self.metrics.finished(429, "server_overloaded", count=shed - self._shed_counted)
            self._shed_counted = shed
        self.metrics.gate(self.gate.running, self.gate.queued)
        self.metrics.adaptive(self.loop.control.describe())

    @app.get("/health")
    async def health(self) -> dict:
        """Liveness: answers whenever the process does, however full its line is (a load
        balancer or probe that restarted a busy router would end every stream it holds)."""
        self.loop.readiness.watch()
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> dict:
        """Readiness: 200 while this replica admits requests, 503 while a request would be
        refused (the target pool still loading, or every slot taken), so that a balancer in
        front of the routers takes such a one out of rotation. `pools`: which pools answer
        (the draft pool is optional: without it requests are served, by the target alone)."""
        readiness = self.loop.readiness
        if not await readiness.wait("target", FIRST_ANSWER_WAIT_S):
            raise loading("target", self.config.pools.router.retry_after_s)
        if not self.gate.admits:
            raise unavailable("This router is at capacity: every slot and place in line is taken.")
        return {"status": "ready", "running": self.gate.running, "queued": self.gate.queued,
                "pools": dict(readiness.ready)}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self.keys.check(request.headers.get("authorization"))
        entry = {"id": self.config.server.model_name, "object": "model", "created": 0,
                 "owned_by": "specserve", "max_model_len": self.config.limits.context_length}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._counted(self._generate(request, CompletionBody, self.admission.completion, COMPLETION))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._counted(self._generate(request, ChatBody, self.admission.chat, CHAT))

    async def _counted(self, generation):
        """The request's outcome in the metrics: its status (a stream counts itself when it ends)."""
        try:
            response = await generation
        except OpenAIError as exc:
            self.metrics.finished(exc.status, exc.code or exc.type)
            raise
        if not isinstance(response, StreamingResponse):
            self.metrics.finished(200)
        return response

    async def describe(self) -> dict:
        """This replica's process and admission state (for tests and operators)."""
        return {"pid": os.getpid(), "running": self.gate.running, "queued": self.gate.queued,
                "refused": self.gate.refused, "shed": self._shed_count, "drafts_available": self.loop.drafts.available,
                "draft_outages": self.loop.drafts.outages, "sequences": self.loop.active_sequences(),
                "adaptive": self.loop.control.describe(),
                "suffix_cache": self.loop.outputs.describe() if self.loop.outputs is not None else None,
                "totals": self.metrics.totals.as_dict(),
                "call_paths": dict(self.loop.call_paths),
                "node_id": ray.get_runtime_context().get_node_id()}

    async def _generate(self, request: Request, body_type: type[_GenerationBody],
                        admit: Callable[..., list[Generation]], fmt: ResponseFormat):
        limits = self.config.limits
        deadline = time.monotonic() + limits.request_timeout_s
        self.keys.check(request.headers.get("authorization"))
        _require_json(request.headers.get("content-type"))
        _check_declared_size(request, limits.max_body_bytes)
        await self._require_target()
        slot = await self._enter(deadline)    # before the body is read: a refusal costs nothing
        streaming = False
        try:
            body = parse_body(body_type, await _read_body(request, limits.max_body_bytes))
            gens = await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads, admit, body)
            if body.stream:
                stream = self._stream(gens, body, fmt, slot, deadline)
                weakref.finalize(stream, slot.release)   # a stream never started frees its slot too
                streaming = True
                return StreamingResponse(stream, media_type="text/event-stream")
            return await self._complete(gens, body, fmt, deadline)
        finally:
            if not streaming:
                slot.release()

    async def _require_target(self) -> None:
        """A request that would wait for a loading target pool is refused within a probe's
        time (router/readiness.py)."""
        if not await self.loop.readiness.wait("target", FIRST_ANSWER_WAIT_S):
            raise loading("target", self.config.pools.router.retry_after_s)

    async def _enter(self, deadline: float) -> Slot:
        self.metrics.gate(self.gate.running, self.gate.queued)
        try:
            return await asyncio.wait_for(self.gate.enter(), max(deadline - time.monotonic(), 0))
        except GateFull:
            raise overloaded(self.config.pools.router.retry_after_s) from None
        except asyncio.TimeoutError:
            raise deadline_exceeded(self.config.limits.request_timeout_s) from None

    def _choices(self, gens: list[Generation], response_id: str, deadline: float,
                 stats: list[SpeculationStats]) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) of every choice as they come; each choice is a sequence of
        its own through the pools, batched with the others like any other."""
        arrival = deadline - self.config.limits.request_timeout_s
        streams = [_until(deadline, self.loop.run(gen, stats[i], seq_id=response_id if len(gens) == 1
                                                  else f"{response_id}-{i}"))
                   for i, gen in enumerate(gens)]
        return interleaved(streams, lambda delta, first, last: self.metrics.tokens(
            len(delta.token_ids), first, time.monotonic() - last), arrival)

    async def _complete(self, gens: list[Generation], body: _GenerationBody, fmt: ResponseFormat,
                        deadline: float) -> dict:
        response_id = fmt.new_id()
        stats = [SpeculationStats() for _ in gens]
        outputs = [ChoiceOutput(gen) for gen in gens]
        try:
            async for i, delta in self._choices(gens, response_id, deadline, stats):
                outputs[i].add(delta)
        except asyncio.TimeoutError:
            raise deadline_exceeded(self.config.limits.request_timeout_s) from None
        except Exception as exc:  # noqa: BLE001 - this request's own failure, told to its client
            logger.warning("generation %s failed: %r", response_id, exc)
            raise _failure(exc) from None
        samples, generated = body.samples_per_prompt(), sum(len(out.ids) for out in outputs)
        shown_logprobs = samples == body.n or body.logprobs is not None   # best_of ranks by them regardless
        if samples > body.n:
            outputs = best_of(outputs, samples, body.n)
        choices = []
        for i, out in enumerate(outputs):
            text, calls = tool_calls(out.text()) if fmt.chat and body.calls_tools() else (out.text(), [])
            choices.append(fmt.choice(i, text, "tool_calls" if calls else out.finish, out.stop_reason,
                                      out.ids if body.return_token_ids else None,
                                      self._logprobs(fmt, out.gen, out.logprobs, out.prompt_logprobs)
                                      if shown_logprobs else None, calls))
        return envelope(fmt.object, response_id, body.model, choices,
                        usage=usage(prompt_tokens(gens, samples), generated),
                        speculation=SpeculationStats.total(stats).as_dict())

    def _logprobs(self, fmt: ResponseFormat, gen: Generation, entries: list[TokenLogprobs] | None,
                  prompt: list[TokenLogprobs] | None, offset: int = 0) -> dict | None:
        """The choice's logprobs object (or a chunk's), when the request asked for them: an
        echoed prompt's tokens first (the very first without one), then the output's."""
        if gen.logprobs is None:
            return None
        decode = self._token_text
        if fmt.chat:
            return chat_logprobs(entries or [], decode)
        pairs = ([(gen.prompt_ids[0], None)] + [(e.token, e) for e in prompt]) if prompt is not None else []
        return completion_logprobs(pairs + [(e.token, e) for e in entries or []], decode, offset)

    def _token_text(self, token: int) -> str:
        """A token's text; where it is part of a character (byte-level tokens), its vocabulary
        entry instead, which names it uniquely (their texts would all be U+FFFD)."""
        text = self.loop.tokenizer.decode([token])
        return self.loop.tokenizer.convert_ids_to_tokens(token) if "\ufffd" in text else text

    async def _stream(self, gens: list[Generation], body: _GenerationBody, fmt: ResponseFormat,
                      slot: Slot, deadline: float) -> AsyncIterator[str]:
        response_id, stats = fmt.new_id(), [SpeculationStats() for _ in gens]
        outputs = [ChoiceOutput(gen) for gen in gens]
        options = body.stream_options
        want_ids, outcome = body.return_token_ids, (200, None)
        prompt_count = prompt_tokens(gens, body.samples_per_prompt())
        # A choice that may call tools streams content, each call's name, then its arguments
        calls = [ToolCallStream() for _ in gens] if fmt.chat and body.calls_tools() else None
        try:
            async for i, delta in self._choices(gens, response_id, deadline, stats):
                out = outputs[i]
                first = not out.deltas
                offset = 0 if first else out.text_length()    # an echoed prompt's tokens come first
                out.add(delta)
                if calls is not None:
                    deltas = calls[i].feed(delta.text, final=delta.finish_reason is not None)
                    finish = delta.finish_reason and ("tool_calls" if calls[i].closed else delta.finish_reason)
                    for choice in tool_call_chunk_choices(i, deltas, first, finish, delta.stop_reason):
                        extra = {"speculation": stats[i].as_dict()} if choice["finish_reason"] else {}
                        yield sse(envelope(fmt.chunk_object, response_id, body.model, [choice], **extra))
                    continue
                if not (delta.text or delta.finish_reason or first or want_ids or delta.logprobs):
                    continue  # nothing a client could see yet (e.g. half a character)
                text = (out.gen.echo or "") + delta.text if first else delta.text
                logprobs = self._logprobs(fmt, out.gen, delta.logprobs, delta.prompt_logprobs, offset)
                choice = fmt.chunk_choice(i, text, delta.finish_reason, delta.stop_reason, first,
                                          delta.token_ids if want_ids else None, logprobs)
                extra = {"speculation": stats[i].as_dict()} if delta.finish_reason else {}
                if options and options.include_usage and options.continuous_usage_stats:
                    extra["usage"] = usage(prompt_count, sum(len(o.ids) for o in outputs))
                yield sse(envelope(fmt.chunk_object, response_id, body.model, [choice], **extra))
            if options and options.include_usage:
                yield sse(envelope(fmt.chunk_object, response_id, body.model, [],
                                   usage=usage(prompt_count, sum(len(o.ids) for o in outputs)),
                                   speculation=SpeculationStats.total(stats).as_dict()))
        except asyncio.TimeoutError:  # the status line is sent: report in-band
            error = deadline_exceeded(self.config.limits.request_timeout_s)
            outcome = (error.status, error.code)
            yield sse(error.body())
        except Exception as exc:  # noqa: BLE001 - this request's own failure, told in-band
            logger.warning("stream %s failed: %r", response_id, exc)
            error = _failure(exc)
            outcome = (error.status, error.code or error.type)
            yield sse(error.body())
        finally:
            slot.release()
            self.metrics.finished(*outcome)
        yield sse("[DONE]")
