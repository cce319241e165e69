"""What one OpenAI response accumulates from its engine chunks, choice by choice
(``responses.Formatter`` folds chunks in and renders it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.reasoning import ReasoningStream
from pagedserve.cluster.tools import ToolContext, ToolStream


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None
    started: bool = False
    echoed: bool = False
    tool_stream: ToolStream | None = None
    reasoning_stream: ReasoningStream | None = None
    token_ids: list[int] = field(default_factory=list)


class ResponseState:
    """Everything a response accumulates; choice ``j`` of prompt ``i`` is ``i * n + j``."""

    def __init__(self, kind: str, rid: str, prompts: list[tuple[int, int]], logprobs: bool,
                 top_n: int | None = None, echo: list[tuple[str, list[int]]] | None = None,
                 tools: ToolContext | None = None, model: str | None = None,
                 reasoning: str | None = None, include_reasoning: bool = True,
                 thought_closed: bool = False, tokens_as_ids: bool = False) -> None:
        """``prompts``: ``(prompt_tokens, n)`` per prompt, in order; ``top_n``: alternatives
        per token in chat ``top_logprobs`` (the engine's dict also holds the sampled token);
        ``echo``: each prompt's text and ids, which lead its choices (completions ``echo``);
        ``tools``: how a chat output turns into tool calls; ``model``: the name the
        response carries when not the server's (a LoRA adapter's); ``reasoning``: the
        reasoning parser splitting a chat output, whose thought is left out unless
        ``include_reasoning`` (``thought_closed``: the prompt ended the thought);
        ``tokens_as_ids``: logprob entries name tokens ``token_id:N`` (vLLM's
        ``return_tokens_as_token_ids``, for tokens that do not decode alone)."""
        self.kind, self.id, self.created, self.logprobs = kind, rid, now(), logprobs
        self.top_n, self.echo, self.tools, self.model = top_n, echo, tools, model
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        self.thought_closed, self.tokens_as_ids = thought_closed, tokens_as_ids
        self.n = [n for _, n in prompts]
        self.prompt_tokens = [p for p, _ in prompts]
        self.cached = [0] * len(prompts)
        self.offsets = [sum(self.n[:i]) for i in range(len(prompts))]
        self.choices = [Choice() for _ in range(sum(self.n))]
        self.prompt_lp_k: int | None = None
        self.prompt_ids: list[list[int]] = []
        self.prompt_lps: list[list[dict[str, Any] | None] | None] = [None] * len(prompts)
        self.token_ids: list[list[int] | None] | None = None

    def want_prompt_logprobs(self, k: int, prompt_ids: list[list[int]]) -> None:
        """Answer vLLM's ``prompt_logprobs`` (the top ``k`` and each token's rank) for
        the prompts ``prompt_ids``: per choice in completions, once in chat."""
        self.prompt_lp_k, self.prompt_ids = k, prompt_ids

    def want_token_ids(self, prompt_ids: list[list[int] | None]) -> None:
        """Answer vLLM's ``return_token_ids``: each choice's output ids, and the prompt's
        ids (per choice in completions, once in chat; streamed first time only)."""
        self.token_ids = prompt_ids

    def prompt_of(self, choice: int) -> int:
        return max(i for i, off in enumerate(self.offsets) if off <= choice)

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens), sum(c.num_tokens for c in self.choices),
                     sum(self.cached))
