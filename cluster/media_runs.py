"""A prompt's image and video runs written out, as the model's processor writes them.

Gemma 3's processor writes each image marker into the text as its full run before
tokenising (under pan-and-scan, a sentence of runs), LLaVA-1.5's repeats ``<image>``
once per patch; Qwen2-VL's and the LLaVA anyres families' runs depend on the
picture's size, so a prompt holds their marker once and the run is written out in
the token ids once the picture is sized (``write_out_runs``, ``place_media``). The
engine (``image_prompts``), ``LLM.chat`` and the HTTP front (``image_chat``) share
these, so each writes the ids the others do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.cluster.multimodal import expand_image_tokens, image_spans


def expand_text(tokenizer: Any, info: dict[str, Any], text: str,
                crops: Sequence[int] | None = None) -> str:
    """``text`` with each image marker written out as its placeholder run, as the
    model's processor writes it (``info``: the worker's ``model_info()["image"]``):
    Gemma 3's begin-of-image token becomes its framed run (under pan-and-scan, its
    sentence of runs: ``crops``, each picture's crop count, is then required), LLaVA's
    image token is repeated once per image token. Qwen2-VL's ``<|image_pad|>`` and
    LLaVA-NeXT's ``<image>`` stay single here: the run's length depends on the
    picture's size, so ``ImagePrompts.build`` writes it out once the picture is
    processed (a special token: the text around it tokenises the same either way)."""
    convert = tokenizer.convert_ids_to_tokens
    marker, image = convert(int(info["marker_token_id"])), convert(int(info["image_token_id"]))
    if not info["tokens_per_image"]:  # one marker an image: written out by ``build``
        return text
    n = int(info["tokens_per_image"])
    if info["family"] == "gemma3":
        if info.get("pan_and_scan") and crops is None:
            raise ValueError("pan-and-scan: each picture's crop count is needed to write "
                             "out its runs (processor_options.crop_counts)")
        return expand_image_tokens(text, marker, image, convert(int(info["eoi_token_id"])), n,
                                   crops)
    return text.replace(marker, image * n)


def expand_single_markers(ids: list[int], info: dict[str, Any]) -> list[int]:
    """Token ids where LLaVA's image token stands once per image, written out to its
    run (a lone id becomes ``tokens_per_image`` of it: no tokeniser is involved, so
    the ids are the processor's); longer runs, other ids and Gemma 3's as they are."""
    n, image = int(info["tokens_per_image"]), int(info["image_token_id"])
    if info["family"] != "llava" or n == 1:
        return ids
    out: list[int] = []
    for i, t in enumerate(ids):
        lone = t == image and (i == 0 or ids[i - 1] != image) \
            and (i + 1 == len(ids) or ids[i + 1] != image)
        out.extend([image] * n if lone else [t])
    return out


def chat_ids(tokenizer: Any, info: dict[str, Any], messages: list[dict[str, Any]],
             add_generation_prompt: bool, crops: Sequence[int] | None = None,
             **template: Any) -> list[int]:
    """The prompt ids of a chat with images: the template rendered to text (an image
    part is its marker: Gemma 3's begin-of-image token, LLaVA's ``<image>``), each
    image's run written out (``crops``: under pan-and-scan, each picture's crop count),
    then tokenised without adding special tokens (the template wrote them), as Hugging
    Face's processor does."""
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template)
    return tokenizer.encode(expand_text(tokenizer, info, text, crops), add_special_tokens=False)


def write_out_runs(ids: list[int], spans: list[tuple[int, int]], counts: list[int],
                   image_token_id: int | Sequence[int], kinds: Sequence[str] | None = None
                   ) -> tuple[list[int], list[tuple[int, int]]]:
    """``ids`` with each image's run ``[a, b)`` made ``counts[i]`` tokens long: a lone
    marker is written out, a run already that long is kept, any other length is a
    ``ValueError`` (the prompt's run does not fit its picture). ``image_token_id``: the
    placeholder, or each run's (images and videos side by side, ``kinds`` naming each)."""
    tokens = [image_token_id] * len(spans) if isinstance(image_token_id, int) \
        else list(image_token_id)
    out: list[int] = []
    new_spans: list[tuple[int, int]] = []
    last = 0
    for i, ((a, b), n, token) in enumerate(zip(spans, counts, tokens, strict=True)):
        if b - a not in (1, n):
            what = kinds[i] if kinds else "image"
            raise ValueError(f"prompt: the {what} at {a} takes {n} placeholder tokens (or one "
                             f"to write out), the run there has {b - a}")
        out += ids[last:a]
        new_spans.append((len(out), len(out) + n))
        out += [token] * n
        last = b
    return out + ids[last:], new_spans


class MediaCountError(ValueError):
    """The prompt marks another number of images (or videos) than it was given."""


def place_media(ids: list[int], kinds: Sequence[str], counts: Sequence[int],
                tokens: dict[str, int]) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt's images and videos side by side (``kinds``: each item's, in the order
    given; ``tokens``: each kind's placeholder id): the items of one kind fill that
    kind's runs in order, each run written out to its item's ``counts``; returns the ids
    and each item's span, in the order given. ``MediaCountError`` names the kind whose
    runs do not match its items (a ``ValueError`` a run of the wrong length)."""
    placed: list[tuple[int, int, int]] = []
    for kind, token in tokens.items():
        items = [i for i, k in enumerate(kinds) if k == kind]
        spans = split_runs(image_spans(ids, token), [counts[i] for i in items])
        if len(spans) != len(items):
            raise MediaCountError(f"{kind}s: the prompt marks {len(spans)} {kind}s (runs of "
                                  f"{kind} token {token}) but {len(items)} were given")
        placed += [(a, b, i) for (a, b), i in zip(spans, items, strict=True)]
    placed.sort()
    ids, spans = write_out_runs(ids, [(a, b) for a, b, _ in placed],
                                [counts[i] for *_, i in placed],
                                [tokens[kinds[i]] for *_, i in placed],
                                [kinds[i] for *_, i in placed])
    out = [(0, 0)] * len(kinds)
    for span, (*_, i) in zip(spans, placed, strict=True):
        out[i] = span
    return ids, out


def split_runs(spans: list[tuple[int, int]], counts: list[int]) -> list[tuple[int, int]]:
    """Each picture's span when a run of the image token may hold several pictures side
    by side (``counts``: each picture's run once written out): a run is the next
    pictures' whole runs (written out already, as the HTTP front sends them) where their
    counts add up to its length, else that many lone markers (as a chat template writes
    them). Where that does not account for every picture, the runs as they are (the
    caller says what is wrong)."""
    out: list[tuple[int, int]] = []
    i = 0
    for a, b in spans:
        k, total = 0, 0
        while i + k < len(counts) and total < b - a:
            total += counts[i + k]
            k += 1
        if total == b - a:
            widths = counts[i:i + k]
        elif i + (b - a) <= len(counts):
            widths = [1] * (b - a)
        else:
            return spans
        for w in widths:
            out.append((a, a + w))
            a += w
        i += len(widths)
    return out if i == len(counts) else spans


def qwen_token_counts(images: Sequence[Any], resize: dict[str, int]) -> list[int]:
    """How many tokens each decoded picture becomes under Qwen2-VL's resize rule
    (``ImageProcessor.resize_facts``): Hugging Face's ``smart_resize`` of its size,
    in ``factor``-pixel cells. ``ValueError`` for a picture it cannot resize."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    f = resize["factor"]
    counts = []
    for img in images:
        height, width = smart_resize(img.height, img.width, factor=f,
                                     min_pixels=resize["min_pixels"],
                                     max_pixels=resize["max_pixels"])
        counts.append((height // f) * (width // f))
    return counts
