"""The FastAPI application: OpenAI and llama-server endpoints over one Provider.

Contract. ``create_app(provider, api_key=None)`` returns an ASGI app with
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``
(503 while loading), ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize`` and
``GET /slots``. Handlers only parse, ask the provider, and format: no model code here.
With ``api_key`` every path but ``/health`` needs ``Authorization: Bearer <key>`` (401
otherwise). Every error is OpenAI's error JSON; an unexpected exception is a 500 of the same
shape and never reaches the engine thread. A streaming response begins only after the first
token, so errors up to then (a queue timeout, an engine failure) keep their HTTP status; a
client that disconnects (streaming or not) has its request cancelled at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import formats as fmt
from .errors import APIError, error_body, unavailable
from .jobs import ClientGone, Job
from .prompts import prepare_chat, prepare_completion
from .provider import Provider
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse

MAX_BODY_BYTES = 8 << 20
# Tokenizing and templating hold the GIL for most of their work, so more threads than this only
# add memory: each new thread gets its own malloc arena (about 14 MiB each after a few requests).
PREPARE_THREADS = 2
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path but the public ones."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                msg = "missing API key (send Authorization: Bearer <key>)" if not got else "invalid API key"
                resp = JSONResponse(error_body(401, msg, code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
        parts.append(chunk)
    return b"".join(parts)


def create_app(provider: Provider, api_key: str | None = None) -> FastAPI:
    # Requests are prepared off the event loop on a pool of fixed size, not Starlette's default
    # pool, which grows with the number of clients waiting at once (up to 40 threads).
    prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="bloomery-prepare")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        prepare_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, fn, *args)

    app = FastAPI(title="bloomery_jax", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status == 400:
            provider.metrics.on_reject("bad_request")
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        traceback.print_exc(file=sys.stderr)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    # --- native endpoints -------------------------------------------------------------------
    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if provider.state == "loading":
            return JSONResponse(error_body(503, "Loading model", code="loading"), status_code=503,
                                headers={"Retry-After": "5"})
        if provider.state == "failed":
            return JSONResponse(error_body(500, f"the model failed: {provider.error}", code="model_failed"),
                                status_code=500)
        running, waiting = provider.counts()
        return {"status": "ok", "slots_processing": running, "slots_idle": provider.engine.n_slots - running,
                "requests_waiting": waiting}

    @app.get("/metrics")
    async def metrics():
        running, waiting = provider.counts()
        n_slots = provider.engine.n_slots if provider.engine is not None else 0
        text = provider.metrics.render(running=running, queued=waiting, slots=n_slots,
                                       queue_bound=provider.options.queue, kv_used=provider.kv_usage(),
                                       in_flight=provider.in_flight(), placement=provider.placement_counters())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/slots")
    async def slots():
        provider.require_ready()
        return provider.slots()

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        bundle = provider.require_ready()
        cfg = provider.engine.cfg
        meta = {"n_vocab": bundle.n_vocab, "n_ctx": bundle.n_ctx,
                "n_ctx_train": int(getattr(cfg, "context_length", bundle.n_ctx)),
                "architecture": provider.engine.model.gguf.architecture, "path": provider.model_path,
                "n_slots": provider.engine.n_slots}
        return {"object": "list", "data": [{"id": bundle.model_id, "object": "model",
                                            "created": int(provider.metrics.started), "owned_by": "bloomery_jax",
                                            "meta": meta}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await _read_body(request))
        tok = provider.require_ready().tokenizer
        ids = await off_loop(tok.encode, req.content, req.add_special, req.parse_special)
        if not req.with_pieces:
            return {"tokens": ids}
        pieces = [{"id": i, "piece": tok.token_bytes(i, special=True).decode("utf-8", errors="replace")}
                  for i in ids]
        return {"tokens": pieces}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await _read_body(request))
        bundle = provider.require_ready()
        for i, t in enumerate(req.tokens):
            if not 0 <= t < bundle.n_vocab:
                raise APIError(400, f"tokens[{i}]: token id {t} is not in [0, {bundle.n_vocab})",
                               param=f"tokens[{i}]", code="invalid_value")
        return {"content": bundle.tokenizer.decode(req.tokens, special=True)}

    # --- generation -------------------------------------------------------------------------
    async def start(request: Request, schema, prepare, prefix: str) -> tuple[Job, object]:
        """Parse, prepare, submit, and wait for the first event (or the client leaving)."""
        body = parse(schema, await _read_body(request))
        bundle = provider.require_ready()
        prepared = await off_loop(prepare, bundle, body)
        job = provider.submit(prepared, asyncio.get_running_loop(), prefix)
        try:
            first = await job.next(request)
        except BaseException:  # ClientGone, or the server cancelling this handler
            provider.cancel(job)
            job.discard()
            raise
        if first.finish_reason == "error":
            raise APIError(500, f"generation failed: {first.error}", code="generation_failed")
        if first.token is None and job.timed_out:
            raise unavailable(f"the request waited {job.time_limit:g} s (the time limit) without getting a slot")
        return job, first

    async def generate(request: Request, chat: bool):
        schema, prepare, prefix = (ChatRequest, prepare_chat, "chatcmpl") if chat else \
            (CompletionRequest, prepare_completion, "cmpl")
        try:
            job, first = await start(request, schema, prepare, prefix)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; frees the handler
        model = provider.bundle.model_id
        if job.prepared.stream:
            async def release():  # also runs when the client left before the body started
                provider.cancel(job)
                job.discard()

            body = _stream(provider, job, first, model, chat)
            return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(release))
        try:
            return await _collect(provider, job, first, model, chat, request)
        except ClientGone:
            return Response(status_code=499)
        finally:
            provider.cancel(job)
            job.discard()

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return BearerAuth(app, api_key) if api_key else app


def _reported(job: Job, ev) -> bool:
    """Whether an event's token shows in logprobs (stop tokens are not part of the output)."""
    return job.prepared.logprobs and ev.token is not None and ev.token not in job.request.stop.stop_tokens


async def _collect(provider: Provider, job: Job, ev, model: str, chat: bool, request: Request):
    tok = provider.bundle.tokenizer
    text, chat_lps, comp_lps = [], [], fmt.CompletionLogprobs()
    n_chars = 0
    while True:
        if ev.finish_reason == "error":
            raise APIError(500, f"generation failed: {ev.error}", code="generation_failed")
        if _reported(job, ev) and chat:
            chat_lps.append(fmt.chat_logprob(tok, ev))
        elif _reported(job, ev):
            comp_lps.add(tok, ev, n_chars)
        text.append(ev.text)
        n_chars += len(ev.text)
        if ev.finish_reason is not None:
            break
        ev = await job.next(request)
    reason = fmt.finish_reason(job, ev.finish_reason)
    if chat:
        return fmt.chat_response(job, model, "".join(text), reason, chat_lps if job.prepared.logprobs else None)
    return fmt.completion_response(job, model, "".join(text), reason,
                                   comp_lps.to_dict() if job.prepared.logprobs else None)


async def _stream(provider: Provider, job: Job, ev, model: str, chat: bool):
    """The SSE body. Starlette cancels it when the client disconnects; ``finally`` frees the slot."""
    tok = provider.bundle.tokenizer
    obj = "chat.completion.chunk" if chat else "text_completion"
    comp_lps, n_chars = fmt.CompletionLogprobs(), 0
    try:
        if chat:
            yield fmt.sse(fmt.chat_chunk(job, model, {"role": "assistant", "content": ""}))
        while True:
            if ev.finish_reason == "error":
                yield fmt.sse(error_body(500, f"generation failed: {ev.error}", code="generation_failed"))
                break
            lp = _reported(job, ev)
            if chat and (ev.text or lp):
                yield fmt.sse(fmt.chat_chunk(job, model, {"content": ev.text},
                                             logprobs=[fmt.chat_logprob(tok, ev)] if lp else
                                             ([] if job.prepared.logprobs else None)))
            elif not chat and (ev.text or lp):
                if lp:
                    comp_lps.add(tok, ev, n_chars)
                yield fmt.sse(fmt.completion_chunk(job, model, ev.text,
                                                   logprobs=comp_lps.take() if job.prepared.logprobs else None))
            n_chars += len(ev.text)
            if ev.finish_reason is not None:
                reason = fmt.finish_reason(job, ev.finish_reason)
                last = fmt.chat_chunk(job, model, {}, reason) if chat else fmt.completion_chunk(job, model, "", reason)
                yield fmt.sse(last)
                if job.prepared.include_usage:
                    yield fmt.sse(fmt.usage_chunk(job, model, obj))
                break
            ev = await job.next()
        yield fmt.SSE_DONE
    finally:
        provider.cancel(job)
        job.discard()
