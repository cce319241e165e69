"""``mm_processor_kwargs``: the options a multimodal model's processor takes, checked, and
Gemma 3's pan-and-scan, which they switch on.

vLLM's ``--mm-processor-kwargs`` passes its JSON to the Hugging Face processor. Here
each family lists what it takes, and a key it does not take (a typo, another model's
option) is a ``ValueError`` naming it before any rank starts, rather than a silent
no-op: Gemma 3's pan-and-scan switches and bounds, Qwen2-VL's picture bounds
(``min_pixels`` / ``max_pixels``, for its pictures and video frames alike, as HF's
processor hands a flat option to every modality that takes it) and video sampling
(``fps`` or ``num_frames``, ``min_frames``, ``max_frames``).

Pan-and-scan (``PanAndScan``) is Gemma 3's answer to pictures far from square: besides
the whole picture, resized to the tower's square, the processor cuts it into 2 to
``max_num_crops`` equal crops along its long side and gives each its own 256 tokens.
The prompt then reads "Here is the original image <the picture's run> and here are
some crops to help you see better <a run per crop>" (``Gemma3Processor
.replace_image_token``). How many crops a picture gets depends only on its size, so a
front end counts them from the decoded picture (``crop_count``) before the replica
processes it, as it counts Qwen2-VL's runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.cluster.pixel_storage import own_storage
from pagedserve.scheduler.multimodal import ImageInput

# Each family's options: key -> (kind, description of what it takes).
_GEMMA3 = {
    "do_pan_and_scan": (bool, "true or false"),
    "pan_and_scan_min_crop_size": (int, "an integer >= 1"),
    "pan_and_scan_max_num_crops": (int, "an integer >= 1"),
    "pan_and_scan_min_ratio_to_activate": (float, "a number > 0"),
}
VIDEO_SAMPLING_KEYS = ("fps", "num_frames", "min_frames", "max_frames")
_QWEN_VL = {
    "min_pixels": (int, "an integer >= 1"),
    "max_pixels": (int, "an integer >= 1"),
    "fps": (float, "a number > 0"),
    "num_frames": (int, "an integer >= 1"),
    "min_frames": (int, "an integer >= 1"),
    "max_frames": (int, "an integer >= 1"),
}
PROCESSOR_OPTIONS: dict[str, dict[str, tuple[type, str]]] = {
    "gemma3": _GEMMA3, "qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL,
    "llava": {}, "llava_next": {},
    "llava_onevision": {k: v for k, v in _QWEN_VL.items() if k in VIDEO_SAMPLING_KEYS},
}


def check_processor_kwargs(kwargs: Mapping[str, Any] | None, model_type: str | None
                           ) -> dict[str, Any]:
    """``kwargs`` checked against what ``model_type``'s processor takes (a copy; ``{}``
    for None). ``ValueError`` names ``mm_processor_kwargs`` and the key: a model without
    a multimodal processor, a key its processor does not take, a value of the wrong
    kind, ``min_pixels`` over ``max_pixels``."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"mm_processor_kwargs must be a JSON object, got {kwargs!r}")
    options = PROCESSOR_OPTIONS.get(model_type or "")
    if options is None:
        raise ValueError(f"mm_processor_kwargs: model type {model_type!r} has no multimodal "
                         "processor to pass them to")
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in options:
            takes = ", ".join(sorted(options)) or "none"
            raise ValueError(f"mm_processor_kwargs.{key}: not an option of {model_type}'s "
                             f"processor (it takes: {takes})")
        kind, what = options[key]
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, int | float) and not isinstance(value, bool)
            and (value >= 1 and float(value).is_integer() if kind is int else value > 0))
        if not ok or (kind is float and not math.isfinite(value)):
            raise ValueError(f"mm_processor_kwargs.{key} must be {what}, got {value!r}")
        out[key] = int(value) if kind is int else float(value) if kind is float else value
    for low, high in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
        lo, hi = out.get(low), out.get(high)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"mm_processor_kwargs: {low} {lo} > {high} {hi}")
    if "fps" in out and "num_frames" in out:
        raise ValueError("mm_processor_kwargs: fps and num_frames are mutually exclusive "
                         "(a rate, or a count of frames)")
    return out


def with_options(base: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (saved fields, or the engine's options) under ``options``: one layer
    over another, where a rate (``fps``) replaces a count (``num_frames``) below it. A
    count always wins over a rate (HF's ``sample_frames``), which then only dates
    frames given already sampled."""
    out = {**base, **options}
    if "fps" in options and "num_frames" not in options:
        out["num_frames"] = None
    return out


@dataclass(frozen=True)
class PanAndScan:
    """Gemma 3's pan-and-scan bounds (``Gemma3Processor.images_kwargs``' defaults): a
    picture whose long side is at least ``min_ratio_to_activate`` times its short side
    is cut into crops of at least ``min_crop_size`` pixels, at most ``max_num_crops``."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    @classmethod
    def bounds(cls, saved: Any, overrides: Mapping[str, Any]) -> PanAndScan:
        """The bounds a Gemma 3 processor whose saved fields are ``saved`` (its
        ``pan_and_scan_*`` attributes; None: the processor's default) cuts with under
        checked ``overrides`` (``check_processor_kwargs``), whether on or not."""
        def pick(name: str) -> Any:
            value = overrides.get(f"pan_and_scan_{name}",
                                  getattr(saved, f"pan_and_scan_{name}", None))
            return getattr(cls, name) if value is None else value

        return cls(int(pick("min_crop_size")), int(pick("max_num_crops")),
                   float(pick("min_ratio_to_activate")))

    @classmethod
    def of(cls, saved: Any, overrides: Mapping[str, Any]) -> PanAndScan | None:
        """``bounds`` where pan-and-scan is on (``do_pan_and_scan`` in ``overrides``,
        else the saved one), None where it is off."""
        on = overrides.get("do_pan_and_scan", getattr(saved, "do_pan_and_scan", None))
        return cls.bounds(saved, overrides) if on else None

    def crop_count(self, height: int, width: int) -> int:
        """How many crops ``Gemma3ImageProcessor.pan_and_scan`` cuts a ``height x width``
        picture into (0: none; the same arithmetic, so a front end's count is the
        processor's)."""
        long, short = (width, height) if width >= height else (height, width)
        if long / short < self.min_ratio_to_activate:
            return 0
        n = min(math.floor(long / short + 0.5), math.floor(long / self.min_crop_size))
        n = min(self.max_num_crops, max(2, n))
        if min(math.ceil(long / n), short) < self.min_crop_size:
            return 0
        return n

    def call_kwargs(self) -> dict[str, Any]:
        """The processor's call arguments that switch it on with these bounds."""
        return {"do_pan_and_scan": True, **{f"pan_and_scan_{k}": v
                                            for k, v in asdict(self).items()}}

    def facts(self) -> dict[str, Any]:
        """The bounds as JSON, for a front end (``from_facts``)."""
        return asdict(self)

    @classmethod
    def from_facts(cls, facts: Mapping[str, Any]) -> PanAndScan:
        return cls(**facts)


class MediaList(list):
    """A prompt's images (and videos) with the request's own processor options (vLLM's
    per-request ``mm_processor_kwargs``), over the engine's: the list travels from the
    ingress or ``LLM.generate`` to the replica as the media list does."""

    def __init__(self, items: Sequence[Any] = (), options: Mapping[str, Any] | None = None
                 ) -> None:
        super().__init__(items)
        self.options = dict(options or {})


def options_of(items: Any) -> dict[str, Any]:
    """The request's processor options a media list carries (``{}``: the engine's)."""
    return dict(getattr(items, "options", None) or {})


def request_info(image_info: Mapping[str, Any], kwargs: Mapping[str, Any] | None
                 ) -> dict[str, Any]:
    """A replica's image facts (``ImagePrompts.info``) as one request's own
    ``mm_processor_kwargs`` change them, so the front end counts crops and runs as the
    replica will: pan-and-scan switched or its bounds moved, Qwen2-VL's picture bounds.
    ``ValueError`` names a key the model's processor does not take."""
    options = check_processor_kwargs(kwargs, image_info.get("family"))
    info = dict(image_info)
    base = info.get("pan_and_scan_bounds")
    if base is not None:
        bounds = PanAndScan.bounds(None, {f"pan_and_scan_{k}": v for k, v in base.items()}
                                   | options)
        if options.get("do_pan_and_scan", bool(info.get("pan_and_scan"))):
            info["pan_and_scan"] = bounds.facts()
        else:
            info.pop("pan_and_scan", None)
    bounds = {k: options[k] for k in ("min_pixels", "max_pixels") if k in options}
    for kind in ("resize", "video"):  # a picture's bounds, a video frame's
        if info.get(kind) and bounds:
            facts = {**info[kind], **bounds}
            if facts["min_pixels"] > facts["max_pixels"]:
                what = "the video processor's" if kind == "video" else "the processor's"
                raise ValueError(f"mm_processor_kwargs: min_pixels {facts['min_pixels']} > "
                                 f"max_pixels {facts['max_pixels']} (the other bound is "
                                 f"{what})")
            info[kind] = facts
    sampling = {k: options[k] for k in VIDEO_SAMPLING_KEYS if k in options}
    if info.get("video") and sampling:
        from pagedserve.cluster.video_processor import sampling_of

        info["video"] = with_options(info["video"], sampling)
        sampling_of(info["video"])  # ``ValueError`` for bounds that cross
    return info


def crop_counts(pictures: Sequence[Any], image_info: Mapping[str, Any]) -> list[int] | None:
    """Each decoded picture's crop count where the model cuts pictures (Gemma 3 with
    pan-and-scan on: ``image_info["pan_and_scan"]``); None where it does not.
    ``ValueError`` where the runs would not fit ``image_info["max_model_len"]``: a
    long thin picture under small crop bounds would otherwise be cut into thousands
    of crops before any length check."""
    facts = image_info.get("pan_and_scan")
    if not facts:
        return None
    pas = PanAndScan.from_facts(facts)
    counts = [pas.crop_count(p.height, p.width) for p in pictures]
    tokens = sum(1 + n for n in counts) * int(image_info.get("tokens_per_image") or 0)
    limit = image_info.get("max_model_len")
    if limit and tokens > limit:
        raise ValueError(f"images: cut by pan-and-scan into {sum(counts)} crops, the "
                         f"pictures take {tokens} tokens, over the model's context of "
                         f"{limit} (mm_processor_kwargs pan_and_scan_*)")
    return counts


def pan_and_scan_text(sequence: str, crops: int) -> str:
    """What one picture's marker becomes: its run (``sequence``, Gemma 3's framed run)
    alone without crops, else ``Gemma3Processor.replace_image_token``'s sentence with a
    run per crop."""
    if not crops:
        return sequence
    return (f"Here is the original image {sequence} and here are some crops to help you "
            "see better " + " ".join([sequence] * crops))


def pan_and_scan_inputs(runs: Sequence[tuple[int, int]], pixels: Sequence[Any],
                        keys: Sequence[str], tokens_per_image: int) -> tuple[ImageInput, ...]:
    """A Gemma 3 prompt's image inputs under pan-and-scan: picture i's ``pixels[i]``
    (``[1 + crops, 3, S, S]``) fills the next ``1 + crops`` runs of ``runs``, one view
    a run, each attended both ways within itself (as ``token_type_ids`` group them in
    HF's mask). A view's key is its picture's with its index. ``ValueError`` where the
    runs do not match the pictures' views."""
    views = [int(p.shape[0]) for p in pixels]
    if len(runs) != sum(views):
        raise ValueError(f"images: the prompt has {len(runs)} image runs, its {len(views)} "
                         f"pictures take {sum(views)} under pan-and-scan (the whole picture "
                         f"and each crop a run: {views})")
    for a, b in runs:
        if b - a != tokens_per_image:
            raise ValueError(f"prompt: an image takes {tokens_per_image} placeholder "
                             f"tokens, the run at {a} has {b - a}")
    at = iter(runs)
    return tuple(ImageInput(*next(at), f"{key}:{j}", own_storage(p[j]), None, False)
                 for p, key, n in zip(pixels, keys, views, strict=True) for j in range(n))
