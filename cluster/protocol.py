"""OpenAI-compatible request models, their mapping to ``SamplingParams``, and error bodies.

Request models are strict (``"5"`` is not an integer, ``true`` is not a number) so a client
with a type bug gets a 400 naming the field instead of a silently coerced request. Fields
that OpenAI defines but this server cannot honour are rejected when set to a non-default
value rather than ignored: a caller relying on them must learn that they did nothing.
Tools are honoured (see ``tools``). Unknown extra fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.scheduler.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

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


class SamplingRequestBase(BaseModel):
    """Fields shared by completions and chat completions (vLLM's extensions included)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower runs first, with --scheduling-policy priority
    request_id: str | None = None  # vLLM's: names the response (else X-Request-Id does)
    use_beam_search: bool = False  # vLLM's: n beams per prompt (cluster/beam_serving.py)
    length_penalty: float = 1.0  # beam search only
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:N"
    return_token_ids: bool | None = None  # vLLM's: prompt and output token ids alongside
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and rank
    # vLLM's: custom logits processors' per-request settings (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise APIError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
                               param="prompt_logprobs")
            if self.stream or self.use_beam_search:
                raise APIError("prompt_logprobs are not available with stream or "
                               "use_beam_search (as in vLLM)", param="prompt_logprobs")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        vocab_size: int | None = None,
                        tool_constraint: StructuredOutputs | None = None) -> SamplingParams:
        """Build the engine's params; a ``ValueError`` becomes a 400 naming the field.

        With ``vocab_size``, token ids in ``stop_token_ids`` and ``logit_bias`` must be
        below it (the engine checks again; here the error names the field).
        ``tool_constraint`` is the output format a ``tool_choice`` imposes; it cannot
        be combined with another output constraint.
        """
        structured = self._structured()
        if tool_constraint is not None:
            if structured is not None:
                raise APIError("tool_choice required or a named function already constrains "
                               "the output; drop response_format / structured outputs",
                               param="tool_choice")
            structured = tool_constraint
        kw: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), bad_words=self.bad_words,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=structured,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self._token_bias(),
            prompt_logprobs=self.prompt_logprobs, extra_args=self.vllm_xargs)
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        try:
            params = SamplingParams(**kw)
            if vocab_size is not None:
                params.check_token_ids(vocab_size)
            return params
        except ValueError as e:
            first = str(e).split(" ", 1)[0]
            param = self.max_tokens_param if first == "max_tokens" else first
            raise APIError(str(e), param=param if param in type(self).model_fields
                           else None) from None

    def _structured(self) -> StructuredOutputs | None:
        """The output constraint, from OpenAI's ``response_format`` or vLLM's
        ``structured_outputs`` / ``guided_*`` fields (one of them at most)."""
        specs: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                specs.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                schema = (rf.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise APIError("response_format json_schema needs json_schema.schema, "
                                   "a JSON schema object", param="response_format")
                specs.append(("response_format", {"json": schema}))
            elif kind == "structural_tag":  # vLLM's: the whole object is xgrammar's tag
                specs.append(("response_format", {"structural_tag": dict(rf)}))
            elif kind != "text":
                raise APIError("response_format type must be text, json_object, "
                               f"json_schema or structural_tag, got {kind!r}",
                               param="response_format")
        if self.structured_outputs is not None:
            specs.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                specs.append((name, {key: getattr(self, name)}))
        if not specs:
            return None
        if len(specs) > 1:
            raise APIError("give at most one of response_format (json), structured_outputs, "
                           "guided_json, guided_regex, guided_choice, guided_grammar",
                           param=specs[1][0])
        param, kw = specs[0]
        try:
            spec = StructuredOutputs(**kw)
            from pagedserve.worker.structured import check_structured_outputs

            check_structured_outputs(spec)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param=param) from None
        return spec

    def truncate(self, ids: list[int]) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM's left truncation)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k < 1:
            raise APIError(f"truncate_prompt_tokens must be >= 1, got {k}",
                           param="truncate_prompt_tokens")
        return ids[-k:]

    def _token_bias(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` keys are token ids written as strings."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids", param="logit_bias") from None

    @property
    def max_tokens_param(self) -> str:
        """The request field that carried the token limit (for error messages)."""
        return "max_tokens"


class CompletionRequest(SamplingRequestBase):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a batch of either;
    ``prompt_embeds`` (vLLM's, ``--enable-prompt-embeds``) one or a batch of base64
    ``torch.save`` tensors ``[tokens, hidden]``, answered before the ``prompt`` ones."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of must equal n (beam-style best_of is not supported)",
                           param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list; an empty prompt or batch is a 400. Beside
        ``prompt_embeds`` no ``prompt``, or an empty one (what OpenAI's client must
        send), is none."""
        if self.prompt is None or (self.prompt_embeds and self.prompt in ("", [""])):
            if not self.prompt_embeds:
                raise APIError("either prompt or prompt_embeds must be given", param="prompt")
            return []
        return as_batch(self.prompt, "prompt", MAX_PROMPTS - len(self.embeds()))

    def embeds(self) -> list[str]:
        """The ``prompt_embeds`` batch as a list of base64 strings (400 if empty or
        too many; ``echo`` has no text to echo for them)."""
        if self.prompt_embeds is None:
            return []
        batch = [self.prompt_embeds] if isinstance(self.prompt_embeds, str) \
            else list(self.prompt_embeds)
        if not batch or any(not x for x in batch):
            raise APIError("prompt_embeds must not be empty", param="prompt_embeds")
        if len(batch) > MAX_PROMPTS:
            raise APIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt_embeds")
        if self.echo:
            raise APIError("echo cannot echo prompt_embeds (they are not text)", param="echo")
        if self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs: prompt_embeds have no tokens to score",
                           param="prompt_logprobs")
        return batch


def as_batch(value: str | list[str] | list[int] | list[list[int]], param: str, limit: int
             ) -> list[str | list[int]]:
    """OpenAI's text / token-id inputs, one or a batch, as a list; empty ones are a 400."""
    batch: list[str | list[int]]
    if isinstance(value, str):
        batch = [value]
    elif not value:
        raise APIError(f"{param} must not be empty", param=param)
    elif isinstance(value[0], int):
        batch = [list(value)]  # type: ignore[arg-type]
    else:
        batch = list(value)  # type: ignore[arg-type]
    if len(batch) > limit:
        raise APIError(f"at most {limit} {param}s per request", param=param)
    if any(len(x) == 0 for x in batch):
        raise APIError(f"{param} must not be empty", param=param)
    return batch


def max_tokens_for(requested: int | None, prompt_len: int, info: dict[str, Any],
                   param: str = "max_tokens", n: int = 1, prompt_param: str = "messages"
                   ) -> int:
    """The token limit of a request, or a 400 if the prompt and limit cannot fit.

    ``info`` holds the replica's ``max_model_len`` and ``pool_tokens``. Without an explicit
    limit a request may run to the end of the context, but never past what the KV pool can
    hold for its ``n`` samples (the engine rejects requests that could never finish).
    A prompt too long is blamed on ``prompt_param`` (a completion's ``prompt``, a
    chat's ``messages``), a limit too high on ``param``.
    """
    limit = info["max_model_len"]
    if prompt_len >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens; the "
                       f"prompt has {prompt_len} tokens", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:  # as much as fits in the context and in the KV pool
        room = (info["pool_tokens"] - prompt_len) // max(1, n)
        if room < 1:
            raise APIError(f"the prompt ({prompt_len} tokens) leaves no room in the KV "
                           f"cache ({info['pool_tokens']} tokens)", param=prompt_param,
                           code="context_length_exceeded")
        return min(limit - prompt_len, room)
    if isinstance(requested, int) and requested > 0 and prompt_len + requested > limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                       f"you requested {prompt_len + requested} tokens ({prompt_len} in "
                       f"the prompt, {requested} for the completion)",
                       param=param, code="context_length_exceeded")
    return requested
