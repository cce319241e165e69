"""Random Qwen2-VL / Qwen2.5-VL checkpoints and short videos, written on the spot for
tests and benchmarks (no model hub: the tower, decoder, tokenizer and processors are
made here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedserve.worker.testing import _spread_weights, write_wordlevel_tokenizer

# Qwen2-VL test files: the vision tokens at the top of a small vocabulary.
QWEN_VL_IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
QWEN_VL_VIDEO_TOKEN = "<|video_pad|>"  # id vocab_size - 8
_QWEN_VL_WORDS = (QWEN_VL_VIDEO_TOKEN, "<|im_start|>", "<|im_end|>", "user", "assistant",
                  *QWEN_VL_IMAGE_TOKENS)
# Qwen2-VL's chat template, cut to what the tests use: an image part is
# <|vision_start|><|image_pad|><|vision_end|>, as the released template renders it.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    " <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def write_random_qwen2_vl(dest: str | Path, kind: str = "qwen2_vl", seed: int = 5,
                          vocab_size: int = 300, vision_config: dict[str, Any] | None = None,
                          max_pixels: int = 56 * 56, **text: Any) -> str:
    """Save a random ``Qwen2VLForConditionalGeneration`` (``kind`` "qwen2_vl") or
    ``Qwen2_5_VLForConditionalGeneration`` ("qwen2_5_vl": RMSNorm, gated MLP, window
    attention) with a small vision tower (patch 7, 2x2 merge), a Qwen2 decoder with
    M-RoPE sections (2, 3, 3) of an 8-wide half head, a word-level tokenizer whose last
    ids are the vision tokens (``QWEN_VL_IMAGE_TOKENS``: start, end, pad; the video pad
    at ``vocab_size - 8``), a Qwen-style chat template and the image processor's config
    (pictures of 14 x 14 to ``max_pixels`` pixels; video frames of 14 x 14 to 112 x 112,
    sampled at 2 per second, at least 2); return its path. ``text`` overrides the decoder's config,
    ``vision_config`` the tower's."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    start, end, pad = vocab_size - 3, vocab_size - 2, vocab_size - 1
    text_cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [2, 3, 3]})
    text_cfg.update(text)
    vision = dict(depth=2, embed_dim=32, num_heads=2, patch_size=7, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    if kind == "qwen2_vl":
        vision.update(hidden_size=text_cfg["hidden_size"], mlp_ratio=2)  # (merger's width)
        cls, config_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig
    elif kind == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=48, out_hidden_size=text_cfg["hidden_size"],
                      window_size=28, fullatt_block_indexes=[1])
        cls, config_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig
    else:
        raise ValueError(f"kind must be 'qwen2_vl' or 'qwen2_5_vl', got {kind!r}")
    vision.update(vision_config or {})
    torch.manual_seed(seed)
    model = cls(config_cls(text_config=text_cfg, vision_config=vision, image_token_id=pad,
                           video_token_id=vocab_size - 8,
                           vision_start_token_id=start, vision_end_token_id=end,
                           bos_token_id=1, eos_token_id=2))
    _spread_weights(model, "visual", ("norm", "ln_"))
    dest = Path(dest)
    model.save_pretrained(dest, safe_serialization=True)
    write_wordlevel_tokenizer(dest, vocab_size, _QWEN_VL_WORDS, QWEN_VL_IMAGE_TOKENS,
                              QWEN_VL_CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 14 * 14, "longest_edge": max_pixels},
                             patch_size=vision["patch_size"], merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(dest))
    (dest / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 14 * 14, "longest_edge": 112 * 112}, "fps": 2.0,
         "min_frames": 2, "max_frames": 16, "temporal_patch_size": 2}))
    return str(dest)


def video_bytes(seed: int, frames: int, fps: int, size: tuple[int, int],
                container: str = "mp4") -> bytes:
    """A short random-noise video (``size``: width, height) encoded with PyAV: H.264 in
    MP4, or VP8 in WebM; each frame a distinct picture."""
    import io

    import av

    codec = {"mp4": "libx264", "webm": "libvpx"}[container]
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
            frame = av.VideoFrame.from_ndarray(pixels.numpy(), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
