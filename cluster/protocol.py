"""OpenAI-compatible request models, their mapping to ``SamplingParams``, and the wire format
between the ingress and the engine replicas.

Request models are strict (``"5"`` is not an integer, ``true`` is not a number) so a client
with a type bug gets a 400 naming the field instead of a silently coerced request. Fields
that OpenAI defines but this server cannot honour (penalties, ``logit_bias``, tools) are
rejected when set to a non-default value rather than ignored: a caller relying on them must
learn that they did nothing. Unknown extra fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.scheduler.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_PROMPTS = 16  # prompts per /v1/completions call (each also bounded by n)


class APIError(Exception):
    """An error the HTTP layer turns into ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param
        self.headers = headers
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope; the ``openai`` client reads ``message`` and ``code`` from it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_body(errors: list[Any]) -> dict[str, Any]:
    """A 400 body for pydantic errors: every problem in the message, the first as ``param``."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        err = first.get("ctx", {}).get("error", "")
        return error_body(f"request body is not valid JSON: {err}", code=400)

    def where(er: Any) -> str:
        return ".".join(str(x) for x in er.get("loc", ()) if x != "body")

    msg = "; ".join(f"{where(er) or 'body'}: {er.get('msg')}" for er in errors[:5])
    return error_body(msg or "invalid request", param=where(first) or None, code=400)


# ---- requests -------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (vLLM's extensions included)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None

    def _check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported by this server (use 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Build the engine's params; a ``ValueError`` becomes a 400 naming the field."""
        kw: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            first = str(e).split(" ", 1)[0]
            param = self.max_tokens_param if first == "max_tokens" else first
            raise APIError(str(e), param=param if param in type(self).model_fields
                           else None) from None

    @property
    def max_tokens_param(self) -> str:
        """The request field that carried the token limit (for error messages)."""
        return "max_tokens"


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._check_unsupported()
        if self.echo:
            raise APIError("echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of must equal n (beam-style best_of is not supported)",
                           param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list; an empty prompt or batch is a 400."""
        p = self.prompt
        batch: list[str | list[int]]
        if isinstance(p, str):
            batch = [p]
        elif not p:
            raise APIError("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            batch = [list(p)]  # type: ignore[arg-type]
        else:
            batch = list(p)  # type: ignore[arg-type]
        if len(batch) > MAX_PROMPTS:
            raise APIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if any(len(x) == 0 for x in batch):
            raise APIError("prompt must not be empty", param="prompt")
        return batch


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; the prompt is the model's chat template applied."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_unsupported()
        if self.tools:
            raise APIError("tools are not supported by this server", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError("only response_format type 'text' is supported",
                           param="response_format")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs requires logprobs to be true",
                               param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
                               param="top_logprobs")

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def max_tokens_for(requested: int | None, prompt_len: int, info: dict[str, Any],
               param: str = "max_tokens", n: int = 1) -> int:
    """The token limit of a request, or a 400 if the prompt and limit cannot fit.

    ``info`` holds the replica's ``max_model_len`` and ``pool_tokens``. Without an explicit
    limit a request may run to the end of the context, but never past what the KV pool can
    hold for its ``n`` samples (the engine rejects requests that could never finish).
    """
    limit = info["max_model_len"]
    if prompt_len >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens; the "
                       f"prompt has {prompt_len} tokens", param="messages",
                       code="context_length_exceeded")
    if requested is None:  # as much as fits in the context and in the KV pool
        room = (info["pool_tokens"] - prompt_len) // max(1, n)
        if room < 1:
            raise APIError(f"the prompt ({prompt_len} tokens) leaves no room in the KV "
                           f"cache ({info['pool_tokens']} tokens)", param="messages",
                           code="context_length_exceeded")
        return min(limit - prompt_len, room)
    if isinstance(requested, int) and requested > 0 and prompt_len + requested > limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                       f"you requested {prompt_len + requested} tokens ({prompt_len} in "
                       f"the prompt, {requested} for the completion)",
                       param=param, code="context_length_exceeded")
    return requested


# ---- responses --------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None
    started: bool = False


class ResponseState:
    """Everything a response accumulates; choice ``j`` of prompt ``i`` is ``i * n + j``."""

    def __init__(self, kind: str, rid: str, prompts: list[tuple[int, int]], logprobs: bool
                 ) -> None:
        """``prompts``: ``(prompt_tokens, n)`` per prompt, in order."""
        self.kind, self.id, self.created, self.logprobs = kind, rid, now(), logprobs
        self.n = [n for _, n in prompts]
        self.prompt_tokens = [p for p, _ in prompts]
        self.cached = [0] * len(prompts)
        self.offsets = [sum(self.n[:i]) for i in range(len(prompts))]
        self.choices = [_Choice() for _ in range(sum(self.n))]

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens), sum(c.num_tokens for c in self.choices),
                     sum(self.cached))


class Formatter:
    """Engine chunks to OpenAI JSON (full responses and SSE events); owns the tokenizer."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tok, self.model = tokenizer, model_name

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _chat_logprobs(self, tokens: list[int], tops: list[dict[int, float]],
                       sampled: list[float | None]) -> list[dict[str, Any]]:
        out = []
        for tid, top, lp in zip(tokens, tops, sampled):
            s = self._text(tid)
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self._text(t), "logprob": v,
                                          "bytes": list(self._text(t).encode())}
                                         for t, v in sorted(top.items(), key=lambda kv: -kv[1])]})
        return out

    def _completion_logprobs(self, tokens: list[int], tops: list[dict[int, float]],
                             sampled: list[float | None], offset: int) -> dict[str, Any]:
        strs, offsets = [], []
        for tid in tokens:
            s = self._text(tid)
            strs.append(s)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": strs, "token_logprobs": list(sampled),
                "top_logprobs": [{self._text(t): v for t, v in
                                  sorted(top.items(), key=lambda kv: -kv[1])} for top in tops],
                "text_offset": offsets}

    def _apply(self, st: ResponseState, i: int, chunk: Any) -> list[tuple[int, Any, Any]]:
        """Fold a chunk into ``st``; returns ``(choice index, delta, delta logprobs)``."""
        st.cached[i] = max(st.cached[i], chunk.cached_tokens)
        out = []
        for d in chunk.deltas:
            c_idx = st.offsets[i] + d.index
            c = st.choices[c_idx]
            lp = None
            if st.logprobs and d.logprobs is not None:
                sampled = d.sampled_logprobs or [None] * len(d.token_ids)
                if st.kind == "chat.completion":
                    lp = self._chat_logprobs(d.token_ids, d.logprobs, sampled)
                    c.logprobs = (c.logprobs or []) + lp
                else:
                    lp = self._completion_logprobs(d.token_ids, d.logprobs, sampled,
                                                   sum(len(t) for t in c.text))
                    if c.logprobs is None:
                        c.logprobs = {k: [] for k in lp}
                    for k, v in lp.items():
                        c.logprobs[k].extend(v)
            c.text.append(d.text)
            c.num_tokens += len(d.token_ids)
            c.finish_reason = d.finish_reason or c.finish_reason
            c.stop_reason = d.stop_reason if d.finish_reason else c.stop_reason
            out.append((c_idx, d, lp))
        return out

    def add(self, st: ResponseState, i: int, chunk: Any) -> None:
        self._apply(st, i, chunk)

    def full_response(self, st: ResponseState) -> dict[str, Any]:
        choices = []
        for k, c in enumerate(st.choices):
            text = "".join(c.text)
            if st.kind == "chat.completion":
                choices.append({"index": k, "message": {"role": "assistant", "content": text},
                                "logprobs": {"content": c.logprobs or []} if st.logprobs
                                else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                choices.append({"index": k, "text": text, "logprobs": c.logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": st.id, "object": st.kind, "created": st.created, "model": self.model,
                "choices": choices, "usage": st.usage()}

    def stream_events(self, st: ResponseState, i: int, chunk: Any, continuous_usage: bool
                      ) -> list[str]:
        events = []
        obj = "chat.completion.chunk" if st.kind == "chat.completion" else "text_completion"
        for c_idx, d, lp in self._apply(st, i, chunk):
            c = st.choices[c_idx]
            if st.kind == "chat.completion":
                delta: dict[str, Any] = {"content": d.text}
                if not c.started:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": c_idx, "delta": delta,
                                          "logprobs": {"content": lp} if lp is not None else None,
                                          "finish_reason": d.finish_reason}
            else:
                choice = {"index": c_idx, "text": d.text, "logprobs": lp,
                          "finish_reason": d.finish_reason}
            if d.finish_reason:
                choice["stop_reason"] = d.stop_reason
            c.started = True
            ev = {"id": st.id, "object": obj, "created": st.created, "model": self.model,
                  "choices": [choice]}
            if continuous_usage:
                ev["usage"] = st.usage()
            events.append(sse(ev))
        return events

    def usage_event(self, st: ResponseState) -> str:
        obj = "chat.completion.chunk" if st.kind == "chat.completion" else "text_completion"
        return sse({"id": st.id, "object": obj, "created": st.created, "model": self.model,
                    "choices": [], "usage": st.usage()})
