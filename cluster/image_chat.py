"""Chat requests with images at the HTTP front: the images fetched and decoded, the
prompt rendered as the model's processor renders it.

The ingress does this, not the engine replica: fetching an image URL may take
seconds, and a bad image is a 400 before any replica is asked. The decoded images
travel in the ``EngineRequest``; the replica preprocesses them (``image_prompts``).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from pagedserve.cluster.chat_protocol import ChatMessage
from pagedserve.cluster.image_prompts import (
    chat_ids,
    qwen_token_counts,
    split_runs,
    write_out_runs,
)
from pagedserve.cluster.multimodal import image_spans, load_image
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.tools import template_extra, template_messages
from pagedserve.scheduler.multimodal import ImageInput
from pagedserve.worker.anyres import facts_token_count


async def chat_images(messages: list[ChatMessage], info: dict[str, Any],
                      allowed_local_media_path: str | None) -> list[Any]:
    """The messages' images in order, decoded (none: ``[]``); a 400 on ``messages`` for
    a model without images or an image that cannot be read."""
    urls = [url for m in messages for url in m.image_urls]
    if not urls:
        return []
    if not info.get("image"):
        raise APIError("this model takes no images (a text model, or the server runs "
                       "with --limit-mm-per-prompt '{\"image\": 0}')", param="messages")
    try:
        return list(await asyncio.gather(*(asyncio.to_thread(
            load_image, url, allowed_local_media_path=allowed_local_media_path)
            for url in urls)))
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def image_chat_ids(tokenizer: Any, messages: list[dict[str, Any]], image: dict[str, Any],
                   add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
                   template_kwargs: dict[str, Any] | None = None,
                   continue_final_message: bool = False) -> list[int]:
    """``image_prompts.chat_ids`` of the request's messages (tools and template
    variables too); a template that cannot render them is a 400 on ``messages``."""
    extra = template_extra(tools, template_kwargs, continue_final_message)
    try:
        return chat_ids(tokenizer, image, template_messages(messages), add_generation_prompt,
                        **extra)
    except Exception as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None


def _picture_counts(images: list[Any], image: dict[str, Any]) -> list[int] | None:
    """Each decoded picture's run, for a model whose runs vary by picture (Qwen2-VL's
    resize, the LLaVA anyres families' canvases); None for a fixed run."""
    resize, anyres = image.get("resize"), image.get("anyres")
    if resize:
        return qwen_token_counts(images, resize)
    if anyres:
        return [facts_token_count(img.height, img.width, anyres, len(images))
                for img in images]
    return None


def written_out(ids: list[int], images: list[Any], image: dict[str, Any]) -> list[int]:
    """A chat's ids with each lone image token written out to its picture's run, where
    runs vary by picture (Qwen2-VL, LLaVA-NeXT, LLaVA-OneVision; counted from the decoded
    size), so the front's length checks and default ``max_tokens`` see the prompt the
    engine runs; other models' are whole already. A mismatch is left for the replica,
    which refuses it with the reason."""
    try:
        counts = _picture_counts(images, image)
        if counts is None:
            return ids
        spans = split_runs(image_spans(ids, int(image["image_token_id"])), counts)
        if len(spans) != len(images):
            return ids
        return write_out_runs(ids, spans, counts, int(image["image_token_id"]))[0]
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def affinity_images(ids: list[int], images: list[Any], image: dict[str, Any]
                    ) -> list[ImageInput]:
    """The images as the router's prefix affinity keys them: each placeholder run with a
    hash of its decoded picture (not the replicas' pixel hash, which needs the resize;
    the router only compares its own keys). Without them two prompts that differ only
    in their image would look like one prefix. ``[]`` when the runs do not match the
    images (the replica refuses the request with the reason)."""
    spans = image_spans(ids, int(image["image_token_id"]))
    try:
        counts = _picture_counts(images, image)
    except ValueError:
        return []
    if counts is not None:
        spans = split_runs(spans, counts)
    if len(spans) != len(images):
        return []
    keys = [hashlib.blake2b(f"{img.mode}|{img.size}|".encode() + img.tobytes(),
                            digest_size=16).hexdigest() for img in images]
    return [ImageInput(a, b, key, None) for (a, b), key in zip(spans, keys, strict=True)]
