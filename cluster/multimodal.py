"""Image inputs for Gemma 3 (``model_type: gemma3``): from what a user sends to model inputs.

One request's images flow so: ``split_chat_images`` takes the image parts out of the OpenAI
messages and leaves ``{"type": "image"}``, which the chat template renders as the
begin-of-image token; ``expand_image_tokens`` turns each of those into Gemma 3's full image
sequence, as ``Gemma3Processor`` does; after tokenizing, ``image_spans`` finds where each
image's soft tokens sit. ``load_image`` reads each source, ``image_processor.ImageProcessor``
makes the pixel values, ``image_hash`` names each image in the prefix-cache keys.

transformers is imported only where an image processor is built or run, so the HTTP front
can split and expand messages without loading it.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.cluster.processor_options import pan_and_scan_text
from pagedserve.worker.anyres import AnyresPixels
from pagedserve.worker.video_pixels import VideoPixels

if TYPE_CHECKING:  # PIL is imported where an image is read: text-only serving needs none
    from PIL import Image

IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def _error(what: str, field: str = "image_url") -> ValueError:
    return ValueError(f"{field}: {what}")


def _too_large(size: int, max_bytes: int, field: str = "image_url") -> ValueError:
    return _error(f"{field.split('_')[0]} is {size} bytes, over the {max_bytes}-byte limit",
                  field)


def load_image(source: str | bytes | Image.Image, *, allowed_local_media_path: str | None = None,
               fetch_timeout_s: float = 10.0, max_bytes: int = 32 * 2**20) -> Image.Image:
    """Read one user-supplied image into an RGB PIL image.

    ``source`` is a PIL image, encoded bytes, a base64 ``data:`` URL, an ``http(s)://`` URL,
    or (only under ``allowed_local_media_path``, vLLM's ``--allowed-local-media-path`` rule)
    a ``file://`` URL or a path; a relative path is taken inside that root. Every failure is
    a ``ValueError`` that names ``image_url``, so the route answers 400, never 500.
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        return _to_rgb(source)
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    elif not isinstance(source, str):
        raise _error(f"expected a URL, bytes or an image, got {type(source).__name__}")
    else:
        data = read_media(source, "image_url", allowed_local_media_path=allowed_local_media_path,
                          fetch_timeout_s=fetch_timeout_s, max_bytes=max_bytes)
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes)
    return _decode(data)


def read_media(source: str, field: str, *, allowed_local_media_path: str | None = None,
               fetch_timeout_s: float = 10.0, max_bytes: int = 32 * 2**20) -> bytes:
    """The bytes a media URL names: a base64 ``data:`` URL, an ``http(s)://`` URL, or a
    ``file://`` URL or path under ``allowed_local_media_path``; every failure is a
    ``ValueError`` naming ``field`` (``image_url``, ``video_url``)."""
    if source[:5].lower() == "data:":
        return _read_data_url(source, max_bytes, field)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch(source, fetch_timeout_s, max_bytes, field)
    if scheme in ("file", ""):
        return _read_local(source, scheme, allowed_local_media_path, max_bytes, field)
    raise _error(f"unsupported URL scheme {scheme!r}: use http(s), data or file", field)


def _read_data_url(url: str, max_bytes: int, field: str) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise _error("data URL has no ',' before its payload", field)
    if not header.lower().endswith(";base64"):
        example = "video/mp4" if field == "video_url" else "image/png"
        raise _error(f"data URL must be base64-encoded (data:{example};base64,...)", field)
    payload = payload.strip()
    if len(payload) > 4 * -(-max_bytes // 3):  # longer than max_bytes could ever encode to
        raise _error(f"data URL decodes to over the {max_bytes}-byte limit", field)
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:  # binascii.Error, or non-ASCII characters
        raise _error("data URL payload is not valid base64", field) from None


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """urllib would also follow a redirect to ftp://; an image URL may only lead to http(s)."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect away from http(s)", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, timeout_s: float, max_bytes: int, field: str) -> bytes:
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "pagedserve"})
    try:
        with opener.open(request, timeout=timeout_s) as response:
            status = response.status
            length = response.headers.get("Content-Length", "")
            too_long = length.isdigit() and int(length) > max_bytes
            data = response.read(max_bytes + 1) if status == 200 and not too_long else b""
    except urllib.error.HTTPError as exc:
        raise _error(f"fetching the URL failed: HTTP {exc.code} {exc.reason}", field) from None
    except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets
        reason = getattr(exc, "reason", None) or exc
        raise _error(f"fetching the URL failed: {reason}", field) from None
    if status != 200:
        raise _error(f"fetching the URL answered HTTP {status}, expected 200", field)
    if too_long:
        raise _too_large(int(length), max_bytes, field)
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, field)
    return data


def _read_local(source: str, scheme: str, allowed_local_media_path: str | None,
                max_bytes: int, field: str) -> bytes:
    if allowed_local_media_path is None:
        raise _error("local files are refused: the server has no --allowed-local-media-path",
                     field)
    if scheme == "file":
        parts = urllib.parse.urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise _error("a file URL must name a local path (file:///...)", field)
        path = Path(urllib.request.url2pathname(parts.path))
    else:
        path = Path(source)
    try:
        root = Path(allowed_local_media_path).resolve()
        resolved = (root / path).resolve()  # symlinks resolved before the check, not after
    except (OSError, ValueError) as exc:  # a NUL byte, a symlink loop
        raise _error(f"bad local path: {exc}", field) from None
    if not resolved.is_relative_to(root):
        raise _error("path is outside the allowed local media path", field)
    try:
        size = resolved.stat().st_size
        if size <= max_bytes:
            return resolved.read_bytes()
    except OSError as exc:
        raise _error(f"cannot read the local file: {exc.strerror or exc}", field) from None
    raise _too_large(size, max_bytes, field)


def _decode(data: bytes) -> Image.Image:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return _to_rgb(image)
    except Image.DecompressionBombError:
        raise _error("image has too many pixels") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, struct.error, ... by format
        raise _error(f"not a decodable image ({type(exc).__name__}: {exc})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """EXIF-upright as HF's ``load_image``; transparency onto white as HF's ``convert_to_rgb``
    (and vLLM), so a transparent PNG gives the pixels HF's processor gives for it."""
    from PIL import Image, ImageOps

    try:
        image = ImageOps.exif_transpose(image)
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as exc:  # an unconvertible mode, a lazily read broken file
        raise _error(f"not a decodable image ({type(exc).__name__}: {exc})") from None


def image_hash(pixel_values: torch.Tensor | AnyresPixels | VideoPixels) -> str:
    """One image's identity in the prefix-cache keys: blake2b-128 of dtype, shape and bytes
    (and an anyres picture's size, which decides its unpadding), so two images share
    cached KV exactly when the model would see the same pixels."""
    size = ""
    if isinstance(pixel_values, VideoPixels):  # the same frames at other times differ
        size = f"video{pixel_values.times}|"
        pixel_values = pixel_values.frames
    if isinstance(pixel_values, AnyresPixels):
        size = f"{pixel_values.height}x{pixel_values.width}|"
        pixel_values = pixel_values.crops
    tensor = pixel_values.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{pixel_values.dtype}|{tuple(pixel_values.shape)}|{size}".encode())
    digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def expand_image_tokens(text: str, boi_token: str, image_token: str, eoi_token: str,
                        tokens_per_image: int, crops: Sequence[int] | None = None) -> str:
    """Each ``boi_token`` replaced by ``"\\n\\n" + boi + image_token * n + eoi + "\\n\\n"``:
    ``Gemma3Processor.full_image_sequence``, substituted as its ``__call__`` does. With
    ``crops`` (pan-and-scan: each picture's crop count, in order) the i-th marker becomes
    its picture's sentence of runs (``processor_options.pan_and_scan_text``);
    ``ValueError`` where the text marks another number of pictures."""
    if not boi_token:
        raise ValueError("boi_token must not be empty")
    if tokens_per_image <= 0:
        raise ValueError(f"tokens_per_image must be positive, got {tokens_per_image}")
    sequence = f"\n\n{boi_token}{image_token * tokens_per_image}{eoi_token}\n\n"
    if crops is None:
        return text.replace(boi_token, sequence)
    pieces = text.split(boi_token)
    if len(pieces) - 1 != len(crops):
        raise ValueError(f"images: the prompt marks {len(pieces) - 1} images (image markers) "
                         f"but {len(crops)} were given")
    out = [pieces[0]]
    for n, piece in zip(crops, pieces[1:], strict=True):
        out += [pan_and_scan_text(sequence, n), piece]
    return "".join(out)


def count_image_placeholders(text: str, boi_token: str) -> int:
    """How many images the rendered prompt asks for (HF's check against the image count)."""
    if not boi_token:
        raise ValueError("boi_token must not be empty")
    return text.count(boi_token)


def image_spans(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image tokens, one run per image: the grouping HF's
    ``get_block_sequence_ids_for_mask`` uses for Gemma 3's bidirectional image attention."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for i, token in enumerate(token_ids):
        if token == image_token_id:
            if start is None:
                start = i
        elif start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(token_ids)))
    return spans


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list[object]]:
    """Take the images out of OpenAI chat messages, leaving ``{"type": "image"}`` where each
    was (what HF chat templates render as the begin-of-image token); the sources come back
    in order of appearance, for ``load_image``. Video parts (``video_url``) leave
    ``{"type": "video"}``, their sources wrapped as ``video.VideoSource``. The inputs are
    not mutated."""
    from pagedserve.cluster.video import VIDEO_PART_TYPES, VideoSource

    converted: list[dict] = []
    sources: list[object] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        content = message.get("content")
        if not isinstance(content, list):
            converted.append(dict(message))
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise ValueError(f"{where} must be an object")
            if part.get("type") in IMAGE_PART_TYPES:
                sources.append(_image_source(part, where))
                parts.append({"type": "image"})
            elif part.get("type") in VIDEO_PART_TYPES:
                sources.append(VideoSource(_video_source(part, where)))
                parts.append({"type": "video"})
            else:
                parts.append(dict(part))
        converted.append({**message, "content": parts})
    return converted, sources


def _video_source(part: dict, where: str) -> object:
    kind = part["type"]
    value = part.get("video") if kind == "video" else part.get("video_url")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None or (isinstance(value, str | bytes) and not value):
        key = "video" if kind == "video" else "video_url"
        raise ValueError(f"{where}: a {kind} part needs '{key}': a URL string or "
                         "{'url': <URL string>}")
    return value


def _image_source(part: dict, where: str) -> object:
    kind = part["type"]
    if kind == "image":
        from PIL import Image

        source = part.get("image")
        if not isinstance(source, str | bytes | Image.Image) or source in ("", b""):
            raise ValueError(f"{where}: an image part needs 'image': a URL, bytes or a PIL image")
        return source
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        if kind == "input_image" and part.get("file_id") is not None:
            raise ValueError(f"{where}: input_image by file_id is not supported; send image_url")
        raise ValueError(f"{where}: an {kind} part needs 'image_url': a URL string or "
                         "{'url': <URL string>}")
    return value
