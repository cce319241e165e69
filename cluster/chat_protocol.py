"""The chat completions request (``POST /v1/chat/completions``): its message models,
OpenAI's text and image content parts, and the chat template arguments a client may
and may not set. The sampling fields it shares with completions are ``protocol``'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.protocol import APIError, SamplingRequestBase
from pagedserve.scheduler.sampling_params import MAX_LOGPROBS


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # (accepted; Gemma 3 has one size)


class ImagePart(BaseModel):
    """OpenAI's image content part: a data URL, an http(s) URL, or a local file under
    the server's ``--allowed-local-media-path``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class VideoURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    url: str


class VideoPart(BaseModel):
    """vLLM's video content part (``video_url``), for a model that takes videos
    (Qwen2-VL): a data URL, an http(s) URL or a local file, as for images."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["video_url"]
    video_url: VideoURL | str

    @property
    def url(self) -> str:
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart | VideoPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @property
    def media(self) -> list[tuple[str, str]]:
        """Each image and video part as ``(kind, url)``, in order."""
        return [("image" if isinstance(p, ImagePart) else "video", p.url)
                for p in self.content or () if isinstance(p, ImagePart | VideoPart)] \
            if isinstance(self.content, list) else []

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: text joined; with images or videos, a
        list of text and ``{"type": "image"}`` / ``{"type": "video"}`` parts (what
        multimodal templates render)."""
        content: str | list[dict[str, str]]
        if isinstance(self.content, list) and self.media:
            content = [{"type": "image"} if isinstance(p, ImagePart)
                       else {"type": "video"} if isinstance(p, VideoPart)
                       else {"type": "text", "text": p.text} for p in self.content]
        else:
            content = self.content if isinstance(self.content, str) else "".join(
                p.text for p in self.content or [] if isinstance(p, TextPart))
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingRequestBase):
    """``POST /v1/chat/completions``; the prompt is the model's chat template applied."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model goes on with the last message
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, e.g. enable_thinking
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, return the thought
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: this request's processor options
    # OpenAI's: how long a reasoning model thinks. A chat template variable, as in vLLM
    # (GPT-OSS's template writes it into the system message; others ignore it).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def check(self) -> None:
        self._check_unsupported()
        check_template_kwargs(self.chat_template_kwargs)
        if self.reasoning_effort is not None:
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort,
                                         **(self.chat_template_kwargs or {})}
        check_continuation(self.continue_final_message, self.add_generation_prompt)
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


# Arguments of apply_chat_template that the server sets itself.
_TEMPLATE_RESERVED = {"conversation", "tools", "tokenize", "add_generation_prompt",
                      "return_dict", "chat_template", "tokenizer", "documents",
                      "continue_final_message"}


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """A prompt either opens a new assistant turn or leaves the last message open, as
    in vLLM (which asks for ``add_generation_prompt: false`` to be said explicitly)."""
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be "
                       "true: set add_generation_prompt to false to continue the final "
                       "message", param="continue_final_message")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """Extra chat template variables may not override what the server passes."""
    taken = sorted(set(kwargs or {}) & _TEMPLATE_RESERVED)
    if taken:
        raise APIError(f"chat_template_kwargs may not set {taken}",
                       param="chat_template_kwargs")
