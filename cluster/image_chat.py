"""Chat requests with images at the HTTP front: the images fetched and decoded, the
prompt rendered as the model's processor renders it.

The ingress does this, not the engine replica: fetching an image URL may take
seconds, and a bad image is a 400 before any replica is asked. The decoded images
travel in the ``EngineRequest``; the replica preprocesses them (``image_prompts``).
Videos likewise: decoded and sampled here (only the sampled frames travel).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from pagedserve.cluster.chat_protocol import ChatMessage
from pagedserve.cluster.media_runs import (
    MediaCountError,
    chat_ids,
    place_media,
    qwen_token_counts,
)
from pagedserve.cluster.multimodal import image_spans, load_image
from pagedserve.cluster.processor_options import crop_counts, request_info
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.tools import template_extra, template_messages
from pagedserve.cluster.video import VideoClip, load_video
from pagedserve.cluster.video_processor import frame_fit, sampling_of, video_token_count
from pagedserve.scheduler.multimodal import ImageInput
from pagedserve.worker.anyres import facts_token_count


def request_image_info(info: dict[str, Any], kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The replica's facts (``EngineServer.info``) as a request's ``mm_processor_kwargs``
    change its images' runs (``processor_options.request_info``); a key the model's
    processor does not take is a 400 on ``mm_processor_kwargs``."""
    if not kwargs or not info.get("image"):
        return info
    try:
        return {**info, "image": request_info(info["image"], kwargs)}
    except ValueError as e:
        raise APIError(str(e), param="mm_processor_kwargs") from None


async def chat_images(messages: list[ChatMessage], info: dict[str, Any],
                      allowed_local_media_path: str | None) -> list[Any]:
    """The messages' images and videos in order, decoded (videos sampled at the model's
    rate: ``video.VideoClip``; none: ``[]``); a 400 on ``messages`` for a model without
    images (or videos) or one that cannot be read."""
    media = [item for m in messages for item in m.media]
    if not media:
        return []
    image = info.get("image")
    if not image:
        raise APIError("this model takes no images (a text model, or the server runs "
                       "with --limit-mm-per-prompt '{\"image\": 0}')", param="messages")
    video = image.get("video")
    if video is None and any(kind == "video" for kind, _ in media):
        raise APIError("this model takes no videos (only Qwen2-VL, Qwen2.5-VL and "
                       "LLaVA-OneVision do, unless --limit-mm-per-prompt has video: 0)",
                       param="messages")

    def load(kind: str, url: str) -> Any:
        if kind == "video":
            return load_video(url, sampling_of(video),
                              allowed_local_media_path=allowed_local_media_path,
                              fit=frame_fit(video, info.get("max_model_len")))
        return load_image(url, allowed_local_media_path=allowed_local_media_path)

    try:
        return list(await asyncio.gather(*(asyncio.to_thread(load, kind, url)
                                           for kind, url in media)))
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def image_chat_ids(tokenizer: Any, messages: list[dict[str, Any]], image: dict[str, Any],
                   add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
                   template_kwargs: dict[str, Any] | None = None,
                   continue_final_message: bool = False,
                   pictures: list[Any] | None = None) -> list[int]:
    """``media_runs.chat_ids`` of the request's messages (tools and template
    variables too; ``pictures``: the decoded ones, whose crop counts write out their
    runs under Gemma 3's pan-and-scan); a template that cannot render them, or
    markers that do not match the pictures, is a 400 on ``messages``."""
    extra = template_extra(tools, template_kwargs, continue_final_message)
    try:
        crops = crop_counts(pictures or [], image)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    try:
        return chat_ids(tokenizer, image, template_messages(messages), add_generation_prompt,
                        crops, **extra)
    except Exception as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None


def _picture_counts(images: list[Any], image: dict[str, Any]) -> list[int] | None:
    """Each decoded picture's (or video's) run, for a model whose runs vary by picture
    (Qwen2-VL's resize, the LLaVA anyres families' canvases); None for a fixed run."""
    resize, anyres = image.get("resize"), image.get("anyres")
    if resize:
        return [video_token_count(x, image["video"]) if isinstance(x, VideoClip)
                else qwen_token_counts([x], resize)[0] for x in images]
    if anyres:  # (LLaVA-OneVision: "several pictures" counts its pictures, not videos)
        pictures = sum(1 for x in images if not isinstance(x, VideoClip))
        return [video_token_count(x, image["video"]) if isinstance(x, VideoClip)
                else facts_token_count(x.height, x.width, anyres, pictures) for x in images]
    return None


def _spans(ids: list[int], images: list[Any], image: dict[str, Any]
           ) -> tuple[list[int], list[tuple[int, int]]] | None:
    """The ids with each run written out and each item's span, where runs vary by
    picture; None where the runs do not match the items (the replica refuses those)."""
    counts = _picture_counts(images, image)
    if counts is None:
        return None
    kinds = ["video" if isinstance(x, VideoClip) else "image" for x in images]
    tokens = {"image": int(image["image_token_id"])}
    if "video" in kinds:
        tokens["video"] = int(image["video_token_id"])
    try:
        return place_media(ids, kinds, counts, tokens)
    except MediaCountError:
        return None


def written_out(ids: list[int], images: list[Any], image: dict[str, Any]) -> list[int]:
    """A chat's ids with each lone image (or video) token written out to its item's run,
    where runs vary by picture (Qwen2-VL, LLaVA-NeXT, LLaVA-OneVision; counted from the
    decoded size), so the front's length checks and default ``max_tokens`` see the prompt
    the engine runs; other models' are whole already. A mismatch is left for the replica,
    which refuses it with the reason."""
    try:
        placed = _spans(ids, images, image)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    return ids if placed is None else placed[0]


def affinity_images(ids: list[int], images: list[Any], image: dict[str, Any]
                    ) -> list[ImageInput]:
    """The images as the router's prefix affinity keys them: each placeholder run with a
    hash of its decoded picture (a video's: its frames and rate; not the replicas' pixel
    hash, which needs the resize; the router only compares its own keys). Without them
    two prompts that differ only in their image would look like one prefix. ``[]`` when
    the runs do not match the images (the replica refuses the request with the
    reason)."""
    try:
        placed = _spans(ids, images, image)
    except ValueError:
        return []
    if placed is not None:
        spans = placed[1]
    else:
        spans = _picture_spans(image_spans(ids, int(image["image_token_id"])),
                               crop_counts(images, image))
        if len(spans) != len(images):
            return []
    items = sorted(zip(spans, images, strict=True), key=lambda item: item[0])
    return [ImageInput(a, b, _decoded_key(x), None) for (a, b), x in items]


def _picture_spans(runs: list[tuple[int, int]], crops: list[int] | None
                   ) -> list[tuple[int, int]]:
    """Each picture's span over its runs: one run a picture, or under pan-and-scan
    (``crops``) the picture's run through its last crop's; the runs as they are where
    they do not add up."""
    if crops is None or len(runs) != sum(1 + n for n in crops):
        return runs
    out, k = [], 0
    for n in crops:
        out.append((runs[k][0], runs[k + n][1]))
        k += 1 + n
    return out


def _decoded_key(item: Any) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(item, VideoClip):
        digest.update(f"video|{item.fps}|".encode())
        for frame in item.frames:
            digest.update(f"{frame.size}|".encode() + frame.tobytes())
    else:
        digest.update(f"{item.mode}|{item.size}|".encode() + item.tobytes())
    return digest.hexdigest()
