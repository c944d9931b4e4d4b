"""Request bodies: strict JSON parsing and pydantic models with OpenAI's types and ranges.

Contract. :func:`parse` turns raw body bytes into one of the models below or raises
:class:`~bloomery_jax.server.errors.APIError` (400) naming the field at fault: invalid JSON
(``NaN``, ``Infinity`` and numbers that overflow to infinity count as invalid), a body that is
not an object, a wrong type (strict: ``"1"`` is not a number, ``1.0`` is not an integer, ``true``
is not a number), a value out of range. Unknown fields are ignored, as OpenAI's many optional
fields come and go between client versions. Checks that need the model (the model name, the
vocabulary size, the context) live in ``prompts``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import bad_request

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; also the engine's static top-n width


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# --- chat messages -------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # templates may read any field
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False


# --- the shared sampling fields ------------------------------------------------------------
class _Generation(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 24)  # beyond any vocabulary: the same as off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)  # llama-server's name
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    user: str | None = None
    timeout: float | None = Field(None, gt=0.0)  # seconds; at most the server's --timeout

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        items = [v] if isinstance(v, str) else v or []
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"key {key!r} is not a token id")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias {value} of token {key} is outside [-100, 100]")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


# --- parsing -------------------------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text} overflows")
    return x


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; 400 for anything else."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(obj).__name__}", code="invalid_json")
    return obj


# pydantic's location entries that name a union member rather than a field
def _is_union_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "dict", "list", "none"} or "[" in part or "-" in part \
        or part.startswith("literal") or part in {"TextPart", "FunctionCall", "ToolCall"}


def field_path(loc: tuple) -> str:
    """pydantic ``loc`` → ``messages[1].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += ("." if out else "") + str(part)
    return out or "body"


def parse(model: type[BaseModel], raw: bytes):
    """Validate a body against ``model``. Raises APIError(400) naming the first bad field."""
    obj = parse_json(raw)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # A union reports one error per member; the most specific (longest path) says the most.
        first = max(errors, key=lambda err: len(err["loc"])) if errors else None
        if first is None:
            raise bad_request("invalid request body") from None
        param = field_path(first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg}", param=param, code="invalid_value") from None
