"""The OpenAI API's request bodies, checked field by field, and its error shape.

Every body is parsed once here into a typed request (pydantic, strict types, unknown fields
refused), so the handlers never read raw JSON. A field slipstream does not act on is refused
when set to anything but its no-op value (``n`` > 1, ``logprobs``, ``tools``, penalties, ...),
never silently ignored. Errors have OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``, and the message names the field.

Beyond OpenAI's fields, three of vLLM's extensions are accepted: ``top_k``, ``ignore_eos`` and
``stop_token_ids``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "parse_body",
]


@dataclass
class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    retry_after: int | None = None
    """Seconds a client should wait before retrying (sent as ``Retry-After``)."""

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk with the token counts (and no choices) before ``[DONE]``."""


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    """An end-user id (OpenAI uses it for abuse monitoring); accepted, not used."""
    top_k: int | None = Field(default=None, ge=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


# Fields accepted only at their no-op value: (field, is it the no-op?, what to do instead).
_NO_OP: list[tuple[str, Any, str]] = [
    ("n", lambda v: v == 1, "send one request per completion"),
    ("best_of", lambda v: v in (None, 1), "send one request per completion"),
    ("presence_penalty", lambda v: v == 0, "leave it at 0"),
    ("frequency_penalty", lambda v: v == 0, "leave it at 0"),
    ("logit_bias", lambda v: not v, "leave it out"),
    ("logprobs", lambda v: v in (None, False), "leave it out"),
    ("top_logprobs", lambda v: v is None, "leave it out"),
    ("echo", lambda v: v is False, "prepend the prompt yourself"),
    ("suffix", lambda v: v is None, "leave it out"),
    ("tools", lambda v: not v, "leave it out"),
    ("tool_choice", lambda v: v in (None, "none"), "leave it out"),
    ("parallel_tool_calls", lambda v: v is None, "leave it out"),
    ("response_format", lambda v: v in (None, {"type": "text"}), "leave it out"),
]


def _refuse_unsupported(req: _Sampling) -> None:
    for name, no_op, instead in _NO_OP:
        if name in type(req).model_fields and not no_op(getattr(req, name)):
            raise ApiError(
                400,
                f"{name}={getattr(req, name)!r} is not supported by this server; {instead}",
                param=name,
                code="unsupported_parameter",
            )
    if len(req.stop_strings()) > 4:
        raise ApiError(400, "stop: at most 4 stop sequences", param="stop")
    prompts: Any = req.prompt if isinstance(req, CompletionRequest) else None
    if isinstance(prompts, list) and len(prompts) > 1 and isinstance(prompts[0], (str, list)):
        raise ApiError(
            400,
            f"prompt: a list of {len(prompts)} prompts; this server takes one prompt per "
            "request (a string or a list of token ids)",
            param="prompt",
        )


R = TypeVar("R", bound=_Sampling)


def _validation_error(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return ApiError(
            400,
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if first["type"] == "missing":
        return ApiError(400, f"Missing required parameter: {param}", param=param)
    return ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value")


def parse_body(raw: bytes, kind: type[R]) -> R:
    """``raw`` as a ``kind`` request.

    Raises:
        ApiError: 400 for a body that is not a JSON object, a missing or unknown field, a value
            of the wrong type or range, or a field set to something this server does not do.
    """
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    try:
        req = kind.model_validate_json(raw)
    except ValidationError as err:
        raise _validation_error(err) from err
    _refuse_unsupported(req)
    return req
