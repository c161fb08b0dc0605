"""The OpenAI API's request bodies and error objects, as the server accepts and answers them.

Bodies are pydantic models in strict mode: a wrong type is refused (``"max_tokens": "ten"``,
``"stream": "yes"``), never coerced, and so are NaN, ±inf (``1e999`` parses as inf) and
numbers out of range — each as a 400 whose error object names the field
(``{"error": {"message", "type", "param", "code"}}``, the shape OpenAI's clients parse).
Fields the OpenAI API has but this server cannot honour (``logprobs``, ``echo``, …) are
refused by name rather than silently ignored; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["ChatBody", "CompletionBody", "Message", "StreamOptions", "TextPart",
           "ValidationError", "error_body", "validation_message"]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_CHOICES = 16

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
MaxTokens = Annotated[int, Field(ge=1)]
StopText = Annotated[str, Field(min_length=1)]  # "" would end every text before it began
Stop = StopText | Annotated[list[StopText], Field(max_length=4)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Part of the API, not of this server: refused by name when set.
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    def unsupported(self) -> str | None:
        """The first field set that this server does not implement."""
        for name in ("logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
                     *self._more_unsupported()):
            value = getattr(self, name)
            if value not in (None, False, 0, 0.0, {}):
                return name
        return None

    def _more_unsupported(self) -> tuple[str, ...]:
        return ()

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionBody(_Sampling):
    """``POST /v1/completions``: ``prompt`` a string, a list of strings, a list of token
    ids or a list of lists of them; ``max_tokens`` defaults to 16, as OpenAI's does."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _more_unsupported(self) -> tuple[str, ...]:
        return ("echo", "suffix") + (("best_of",) if self.best_of not in (None, 1) else ())


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the run's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    tools: Any = None
    response_format: Any = None

    def _more_unsupported(self) -> tuple[str, ...]:
        return ("tools", "response_format")


def error_body(message: str, kind: str = "invalid_request_error", *,
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _shown(value: Any) -> str:
    text = repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's (or FastAPI's) errors → one message naming the field, and that field."""
    if not errors:
        return "the request body is not valid", None
    err = errors[0]
    loc = [part for part in err.get("loc", ()) if part != "body"]
    if err.get("type") == "json_invalid":
        return f"the body is not valid JSON: {err.get('msg', '')}".rstrip(": "), None
    if not loc:
        return f"the body must be a JSON object: {err.get('msg', '')}", None
    # Union members show up in the location as type names ('str', 'list[int]'): keep the
    # field path only.
    path = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p)
            and str(p) not in ("str", "int", "float", "bool", "function-after"))]
    param = path[0] if path else str(loc[0])
    where = param + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path[1:])
    message = err.get("msg", "is not valid")
    got = f" (got {_shown(err['input'])})" if "input" in err and err["type"] != "missing" else ""
    return f"{where}: {message}{got}", param

