"""The OpenAI API's request and response shapes, as ``spade serve`` speaks them.

Requests are parsed into pydantic models (unknown fields are ignored, as OpenAI's
``extra_body`` may carry them; known fields spade cannot honour are refused when set
to anything but their default), then turned into ``SamplingParams``. Every refusal is an
``APIError`` that names the request field (``param``) and becomes the OpenAI error
object ``{"error": {"message", "type", "param", "code"}}``.

>>> req = CompletionRequest.model_validate({"model": "m", "prompt": "Hi", "max_tokens": 4})
>>> to_sampling_params(req, default_max_tokens=16).max_tokens
4

No torch and no FastAPI here: the module is pydantic and the standard library only.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spade.errors import ArgumentError, ArgumentTypeError, ConfigError
from spade.serving.params import RequestOutput, SamplingParams


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error object's fields."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------- requests
# strict: JSON types as sent ("5" is not a number, "yes" not a bool), as OpenAI checks them
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Sampling fields are checked by ``SamplingParams``,
    so that the server and the library refuse the same values with the same words."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    user: Optional[str] = None
    # refused unless left at their defaults (spade samples one sequence, no penalties)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    logprobs: Optional[Any] = None
    best_of: Optional[int] = None


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=0)
    max_completion_tokens: Optional[int] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None


_EXPECTED = {"prompt": "a string, a list of token ids, or a list holding one of those",
             "stop": "a string or a list of strings",
             "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})"}
"""What a union-typed field takes, for the message when a value matches none of its types."""


def _is_tag(p) -> bool:
    """pydantic's name of a union member in an error's location (``str``, ``list[int]``)."""
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p)


def _loc(loc: tuple) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_tag(p):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out or "body"


def parse_request(kind: type[_Request], body: Any) -> _Request:
    """``body`` (decoded JSON) as a ``kind`` request, or ``APIError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", param="body")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = _loc(tuple(err["loc"]))
        got = err.get("input")
        got_s = "" if err["type"] == "missing" or isinstance(got, (dict, list)) else f" (got {got!r})"
        msg = err["msg"]
        if err["loc"] and _is_tag(err["loc"][-1]):  # no member of a union took it
            field = [p for p in err["loc"] if isinstance(p, str) and not _is_tag(p)][-1]
            msg, got_s = f"expected {_EXPECTED.get(field, 'another type')}, got {type(got).__name__}", ""
        raise APIError(f"{where}: {msg}{got_s}", param=where.split("[")[0].split(".")[0]) from None


def _refuse_unsupported(req: _Request) -> None:
    def no(field: str, why: str) -> None:
        raise APIError(f"{field}: {why}", param=field)

    if req.n != 1:
        no("n", f"spade returns one choice per request, got n={req.n}; send n requests instead")
    if req.best_of not in (None, 1):
        no("best_of", f"not supported (got {req.best_of}); leave it out")
    for f in ("presence_penalty", "frequency_penalty"):
        if getattr(req, f) not in (None, 0, 0.0):
            no(f, f"penalties are not supported (got {getattr(req, f)}); leave it out or set 0")
    if req.logit_bias:
        no("logit_bias", "not supported; leave it out")
    if req.logprobs not in (None, False, 0):
        no("logprobs", "log-probabilities are not returned by spade; leave it out")
    if isinstance(req, CompletionRequest):
        if req.echo:
            no("echo", "not supported; leave it out or set false")
        if req.suffix:
            no("suffix", "not supported; leave it out")
    if isinstance(req, ChatCompletionRequest):
        if req.tools:
            no("tools", "tool calls are not supported; leave it out")
        if req.response_format and req.response_format.get("type", "text") != "text":
            no("response_format", f"only type 'text' is supported, got {req.response_format.get('type')!r}")


def to_sampling_params(req: _Request, *, default_max_tokens: int) -> SamplingParams:
    """The request's ``SamplingParams``; a bad value is an ``APIError`` naming its field
    (``SamplingParams`` checks the values, so the library and the server agree)."""
    _refuse_unsupported(req)
    max_tokens = req.max_tokens
    field = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    kw: dict[str, Any] = {"max_tokens": default_max_tokens if max_tokens is None else max_tokens,
                          "ignore_eos": req.ignore_eos}
    for f in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids"):
        v = getattr(req, f)
        if v is not None:
            kw[f] = v
    try:
        return SamplingParams(**kw)
    except (ArgumentError, ArgumentTypeError) as e:
        msg = str(e).removeprefix("SamplingParams.")
        name = msg.split(":", 1)[0].split("[")[0]
        if name == "max_tokens":
            name, msg = field, field + msg[len("max_tokens"):]
        raise APIError(msg, param=name) from None


def engine_error(e: Exception) -> APIError:
    """An error ``AsyncEngine.generate`` raised before any work, as a 400 naming the
    field when its message starts with one (``SamplingParams.top_p: ...``, ``prompt: ...``)."""
    msg = " ".join(str(e).split()) or type(e).__name__
    head = msg.split(":", 1)[0] if ":" in msg else ""
    param = None
    if head and " " not in head:
        param = head.removeprefix("SamplingParams.").split("[")[0].split(".")[-1] or None
    if isinstance(e, ConfigError) and "max_seq_len" in msg:
        param = param or "max_tokens"
    return APIError(msg, param=param)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as ``[{"role", "content"}]`` with text content, checked."""
    if not req.messages:
        raise APIError("messages: the list is empty; give at least one message, e.g. "
                       '[{"role": "user", "content": "Hello"}]', param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(f"messages[{i}].role: {m.role!r} is not a role (system, user, assistant, developer, "
                           "tool)", param="messages")
        content = m.content
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                   f"{part.get('type')!r}", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        # OpenAI's newer name for the system role, which chat templates know
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """Chat messages as plain text, for a model without a chat template (a random-weight
    preset has no tokenizer): one ``role: content`` line each, then ``assistant:``."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


# --------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_response(rid: str, model: str, created: int, out: RequestOutput) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason}],
            "usage": usage(out)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     stop_reason=None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_response(rid: str, model: str, created: int, out: RequestOutput) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": None, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}],
            "usage": usage(out)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               stop_reason=None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, obj: str, out: RequestOutput) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(out)}


def now() -> int:
    return int(time.time())


__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions",
           "parse_request", "to_sampling_params", "engine_error", "chat_messages", "plain_chat_prompt",
           "completion_response", "completion_chunk", "chat_response", "chat_chunk", "usage_chunk", "usage",
           "new_id", "now"]
