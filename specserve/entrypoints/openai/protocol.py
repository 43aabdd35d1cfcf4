"""Request bodies of the OpenAI-compatible API as vLLM takes them (pydantic models: unknown fields are
ignored), the server's caps on a request, and the translation of a request into the engine's
``SamplingParams`` (one per choice: ``n`` stays in the server) with one-line errors naming the field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from specserve.config import MAX_LOGPROBS, SamplingParams

Number = Union[StrictInt, StrictFloat]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error's body (OpenAI's shape)."""

    error: ErrorDetail


@dataclass
class Limits:
    """What one request may ask for (``specserve serve`` flags): choices per request, tokens per
    choice (None: up to max_model_len), logprob alternatives, stop strings and their length, prompts
    per request, body bytes, request line + header bytes."""

    max_n: int = 16
    max_tokens: int | None = None
    max_logprobs: int = MAX_LOGPROBS
    max_stop: int = 16
    max_stop_len: int = 256
    max_prompts: int = 64
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 32 * 1024


class RequestError(Exception):
    """A request the server refuses: HTTP status, one-line message, the offending field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


def _integral(v):
    """JSON's integers: an int, or a float with no fraction (1.0); never a bool or a string."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("Input should be a valid integer")
    return v


Int = Annotated[int, BeforeValidator(_integral)]
Positive = Annotated[Int, Field(ge=1)]
TokenId = Annotated[Int, Field(ge=0)]
Text = Annotated[StrictStr, Field(min_length=1)]


class _Sampling(_Body):
    model: StrictStr | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: Annotated[Int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    n: Positive = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False


# a string, strings, token ids, lists of token ids: none empty
Prompt = Union[Text, Annotated[list[Text], Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)],
               Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True


class TokenizeRequest(_Body):
    """``prompt`` or ``messages`` (neither: no tokens)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], Field(min_length=1)]


# the members of a union in pydantic's error locations (``prompt.list[int].0``): not field names
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's first error as (one line naming the field, the field's name)."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if not _TYPE_TAG.match(str(x))]
    field = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    return (f"{field}: {msg}" if field else msg), (loc[0] if loc else None)


def sampling_params(req: _Sampling, max_tokens: int | None, logprobs: int | None, limits: Limits,
                    max_model_len: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice (``n``): seeds seed, seed+1, ... when a seed is given."""
    if not 1 <= req.n <= limits.max_n:
        raise RequestError(f"n must be in 1..{limits.max_n}, got {req.n}", param="n")
    if max_tokens is not None and not 1 <= max_tokens <= (limits.max_tokens or max_model_len):
        raise RequestError(f"max_tokens must be in 1..{limits.max_tokens or max_model_len}, got {max_tokens}",
                           param="max_tokens")
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise RequestError(f"logprobs must be in 0..{limits.max_logprobs}, got {logprobs}", param="logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise RequestError(f"stop: at most {limits.max_stop} strings, got {len(stop)}", param="stop")
    if any(len(s) > limits.max_stop_len for s in stop):
        raise RequestError(f"stop: each string at most {limits.max_stop_len} characters", param="stop")
    if len(req.stop_token_ids or []) > limits.max_stop:
        raise RequestError(f"stop_token_ids: at most {limits.max_stop} ids", param="stop_token_ids")
    kw = dict(temperature=1.0 if req.temperature is None else req.temperature,
              top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
              min_p=0.0 if req.min_p is None else req.min_p, max_tokens=max_tokens, stop=stop,
              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
              skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)
    if req.seed is not None and not -(2**63) <= req.seed < 2**63 - req.n:
        raise RequestError(f"seed must fit in 64 bits, got {req.seed}", param="seed")
    try:
        return [SamplingParams(seed=None if req.seed is None else req.seed + i, **kw) for i in range(req.n)]
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise RequestError(msg, param=msg.split(" ", 1)[0]) from None
