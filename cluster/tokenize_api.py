"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the token ids a prompt or a chat
would run on, and text back from ids (the checks shared with chat completions live in
``protocol``). The routes live on an ``APIRouter`` bound to this module's mixin;
``OpenAIServer`` inherits it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from pagedserve.cluster.chat_protocol import ChatMessage, check_continuation, check_template_kwargs
from pagedserve.cluster.image_chat import chat_images, request_image_info, written_out
from pagedserve.cluster.protocol import APIError

router = APIRouter()


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
    mm_processor_kwargs: dict[str, Any] | None = None

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


class TokenizeEndpoints:
    """Mixed into ``OpenAIServer``, which provides ``_authorize``, ``_check_model``,
    ``_engine_info``, ``_chat_ids``, ``allowed_local_media_path`` and the tokenizer."""

    @router.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, raw: Request) -> dict[str, Any]:
        """vLLM's: the token ids a completions prompt or a chat would start from."""
        self._authorize(raw)
        body.check()
        self._check_model(body.model)
        info = await self._engine_info()
        if body.messages is not None:
            info = request_image_info(info, body.mm_processor_kwargs)
            image = info.get("image") or {}
            images = None
            if image.get("resize") or image.get("anyres") or image.get("pan_and_scan"):
                # runs by picture size: the pictures are read to count them
                images = await chat_images(body.messages, info, self.allowed_local_media_path)
            ids = self._chat_ids(body.messages, body.add_generation_prompt, body.tools,
                                 body.chat_template_kwargs, body.continue_final_message, info,
                                 images)
            ids = written_out(ids, images, info["image"]) if images else ids
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": info["max_model_len"]}

    @router.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, raw: Request) -> dict[str, Any]:
        self._authorize(raw)
        self._check_model(body.model)
        info = await self._engine_info()
        if any(not 0 <= t < info["vocab_size"] for t in body.tokens):
            raise APIError("tokens must be within the vocabulary", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}
