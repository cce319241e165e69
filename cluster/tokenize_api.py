"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies: the token ids a prompt or a
chat would run on, and text back from ids (the checks shared with chat completions
live in ``protocol``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.cluster.protocol import (
    APIError,
    ChatMessage,
    check_continuation,
    check_template_kwargs,
)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        check_template_kwargs(self.chat_template_kwargs)
        if self.messages is not None:
            check_continuation(self.continue_final_message, self.add_generation_prompt)
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise APIError("messages must not be empty", param="messages")


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]
