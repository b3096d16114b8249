"""The OpenAI-compatible HTTP server: a Starlette app in front of an :class:`EngineRunner`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream":
true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``.
Each request is checked in full before it reaches the engine (``openai_api.py``: 400 with
OpenAI's error shape, naming the field); a request past the admission bound gets 503 with
``Retry-After``; a client that disconnects has its request aborted, which frees its KV-cache
blocks. Text is decoded from the tokens as they come (whole-text decode, so multi-byte
characters are never split) and ``stop`` strings are found in it, holding back as many
characters as a stop string could still need.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slipstream._logging import logger
from slipstream.config._errors import ConfigError
from slipstream.inference.pretrained import decode_ids, encode_chat, encode_text
from slipstream.inference.serving.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    parse_body,
)
from slipstream.inference.serving.protocol import GenerationEngine, RequestOutput, SamplingParams
from slipstream.inference.serving.runner import EngineFailure, EngineRunner, Overloaded

__all__ = ["ServeOptions", "build_app"]


@dataclass(frozen=True)
class ServeOptions:
    """How the server admits and names things."""

    model_name: str
    """The id ``/v1/models`` lists; requests must name it."""
    max_pending: int = 64
    """Requests queued or running at most; more get 503 with ``Retry-After``."""
    retry_after_s: int = 1
    """The ``Retry-After`` a 503 carries."""
    backend: str = "static"
    """Which engine serves (reported by ``/health``)."""
    params_type: Callable[..., Any] = field(default=SamplingParams)
    """The engine's sampling-params class (its fields are :class:`SamplingParams`')."""


class _Detokenizer:
    """A request's text so far, as chunks to send (see the module docstring)."""

    def __init__(self, tok: Any, stops: tuple[str, ...]) -> None:
        self.tok = tok
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out

    def add(self, out: RequestOutput) -> tuple[str, bool]:
        """The new text to send and whether a stop string ended it."""
        new = out.new_token_ids
        if out.finished and out.finish_reason == "stop" and new:
            new = new[:-1]  # the EOS or stop token ends the text, it is not part of it
        self.ids += new
        text = decode_ids(self.tok, self.ids)
        cuts = [i for s in self.stops if (i := text.find(s, max(0, self.sent - len(s)))) >= 0]
        if cuts:
            text, limit = text[: min(cuts)], min(cuts)
        elif out.finished:
            limit = len(text)
        else:
            limit = len(text.rstrip("\ufffd")) - self.hold  # an incomplete character waits
        chunk = text[self.sent : limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return chunk, bool(cuts)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@dataclass
class _Job:
    """One admitted request: what the handlers need to answer it."""

    chat: bool
    request_id: str
    prompt_len: int
    outputs: asyncio.Queue[RequestOutput | EngineFailure]
    detok: _Detokenizer
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, model: str, text: str | None, reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": model,
            "choices": [choice],
        }


class _Server:
    """The handlers, over one runner and tokenizer."""

    def __init__(self, runner: EngineRunner, tok: Any, options: ServeOptions) -> None:
        self.runner = runner
        self.tok = tok
        self.options = options

    # -- admission -------------------------------------------------------------------------

    def _prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            roles = {"developer": "system"}
            messages = [{"role": roles.get(m.role, m.role), "content": m.text()}
                        for m in req.messages]  # fmt: skip
            try:
                return encode_chat(self.tok, messages)
            except ConfigError as err:
                raise ApiError(400, str(err), param="messages") from err
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode_text(self.tok, prompt)
        size = len(self.tok) if hasattr(self.tok, "__len__") else None
        bad = [t for t in prompt if t < 0 or (size is not None and t >= size)]
        if bad:
            raise ApiError(400, f"prompt: token {bad[0]} is not in the vocabulary", "prompt")
        return [int(t) for t in prompt]

    def _params(self, req: CompletionRequest | ChatRequest, prompt_len: int) -> Any:
        limit = self.runner.engine.max_model_len
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        if isinstance(req, ChatRequest):
            wanted = req.max_completion_tokens or req.max_tokens
        else:
            wanted = req.max_tokens
        new = wanted if wanted is not None else limit - prompt_len
        if prompt_len == 0:
            raise ApiError(400, f"{param}: the prompt is empty", param=param)
        if prompt_len + max(new, 1) > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{prompt_len + new} ({prompt_len} in the {param}, {new} to generate): shorten "
                "the prompt or lower max_tokens",
                param=param,
                code="context_length_exceeded",
            )
        temperature = 1.0 if req.temperature is None else req.temperature
        return self.options.params_type(
            max_new_tokens=new,
            temperature=temperature if temperature > 0 else 1.0,
            top_k=req.top_k,
            top_p=req.top_p,
            do_sample=temperature > 0,
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
        )

    async def _admit(self, request: Request, kind: type[Any]) -> tuple[Any, _Job]:
        req = parse_body(await request.body(), kind)
        if req.model != self.options.model_name:
            raise ApiError(
                404,
                f"the model {req.model!r} does not exist; this server serves "
                f"{self.options.model_name!r}",
                param="model",
                code="model_not_found",
            )
        prompt_ids = self._prompt_ids(req)
        params = self._params(req, len(prompt_ids))
        chat = kind is ChatRequest
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            outputs = self.runner.submit(request_id, prompt_ids, params)
        except Overloaded as err:
            raise ApiError(
                503,
                f"the server is at capacity ({err}); retry after {self.options.retry_after_s} s",
                type="server_overloaded",
                retry_after=self.options.retry_after_s,
            ) from err
        usage = bool(req.stream_options and req.stream_options.include_usage)
        detok = _Detokenizer(self.tok, req.stop_strings())
        return req, _Job(chat, request_id, len(prompt_ids), outputs, detok, usage)

    # -- answers ---------------------------------------------------------------------------

    async def _next(self, request: Request, job: _Job) -> RequestOutput | EngineFailure | None:
        """The job's next output; None once the client has gone (the job is aborted)."""
        getter = asyncio.ensure_future(job.outputs.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.25)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    self.runner.abort(job.request_id)
                    logger.info("serve: %s: the client disconnected; aborted", job.request_id)
                    return None
        finally:
            getter.cancel()  # no-op when it is done; else the handler itself was cancelled

    async def _outputs(
        self, request: Request, job: _Job
    ) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text, finish reason or None, tokens so far) per engine output; aborts the job if
        the caller stops early."""
        tokens, finished = 0, False
        try:
            while True:
                item = await self._next(request, job)
                if item is None:
                    return
                if isinstance(item, EngineFailure):
                    status = "server_error" if item.status >= 500 else "invalid_request_error"
                    raise ApiError(item.status, item.message, type=status)
                if item.finish_reason == "abort":
                    raise ApiError(
                        503, "the request was aborted by the engine", type="server_error"
                    )
                tokens += len(item.new_token_ids)
                text, stopped = job.detok.add(item)
                reason = "stop" if stopped else item.finish_reason if item.finished else None
                if stopped and not item.finished:
                    self.runner.abort(job.request_id)  # a stop string: the engine stops too
                finished = reason is not None
                yield text, reason, tokens
                if finished:
                    return
        finally:
            if not finished:
                self.runner.abort(job.request_id)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, CompletionRequest)

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, ChatRequest)

    async def _answer(self, request: Request, kind: type[Any]) -> Response:
        req, job = await self._admit(request, kind)
        if req.stream:
            return StreamingResponse(
                self._events(request, job),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        texts, reason, tokens = [], None, 0
        async for text, why, count in self._outputs(request, job):
            texts.append(text)
            reason, tokens = why, count
        if reason is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        text = "".join(texts)
        if job.chat:
            choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
        else:
            choice = {"text": text}
        body = job.chunk(self.options.model_name, "", reason)
        body["object"] = "chat.completion" if job.chat else "text_completion"
        body["choices"] = [{"index": 0, **choice, "logprobs": None, "finish_reason": reason}]
        body["usage"] = _usage(job.prompt_len, tokens)
        return JSONResponse(body)

    async def _events(self, request: Request, job: _Job) -> AsyncIterator[str]:
        name = self.options.model_name

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        if job.chat:
            yield event(job.chunk(name, None, None))  # the role comes first
        tokens = 0
        try:
            async for text, reason, count in self._outputs(request, job):
                tokens = count
                if text or reason:
                    yield event(job.chunk(name, text, reason))
        except ApiError as err:  # the headers are sent: report it as an event
            yield event(err.body())
        if job.include_usage:
            payload = job.chunk(name, "", None) | {"choices": []}
            yield event(payload | {"usage": _usage(job.prompt_len, tokens)})
        yield "data: [DONE]\n\n"

    # -- the rest --------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        card = {"id": self.options.model_name, "object": "model", "created": 0,
                "owned_by": "slipstream"}  # fmt: skip
        if "model" in request.path_params:
            if request.path_params["model"] != self.options.model_name:
                raise ApiError(404, f"the model {request.path_params['model']!r} does not exist",
                               param="model", code="model_not_found")  # fmt: skip
            return JSONResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        stats = self.runner.stats
        return JSONResponse(
            {"status": "ok", "model": self.options.model_name, "backend": self.options.backend,
             "pending": stats.pending, "free_blocks": stats.free_blocks,
             "total_blocks": stats.total_blocks, "steps": stats.steps}
        )  # fmt: skip


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=exc.status_code)


def build_app(engine: GenerationEngine, tokenizer: Any, options: ServeOptions) -> Starlette:
    """The server's ASGI app. Its lifespan starts the engine thread and, at shutdown (after
    the ASGI server has let in-flight requests finish), aborts what is left and joins it."""
    runner = EngineRunner(engine, options.max_pending)
    server = _Server(runner, tokenizer, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner.start(asyncio.get_running_loop())
        logger.info("serve: %s on the %s engine", options.model_name, options.backend)
        yield
        runner.stop()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)  # type: ignore[arg-type]
    app.state.runner = runner
    return app
