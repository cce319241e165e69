"""Qwen2-VL's and Qwen2.5-VL's image encoder against Hugging Face's ``visual`` on tiny random
models, fed by HF's own (PIL) image processor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedserve.worker.loaders.hf import iter_safetensors
from pagedserve.worker.models.qwen2_vision import (
    Qwen2VisionEncoder,
    image_grid,
    patches_to_images,
)

CPU = torch.device("cpu")
P, M, TP = 7, 2, 2
TEXT = dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, vocab_size=300, bos_token_id=1, eos_token_id=2)
VISION = {
    "qwen2_vl": dict(depth=3, embed_dim=32, num_heads=2, hidden_size=48, mlp_ratio=2,
                     patch_size=P, spatial_merge_size=M, temporal_patch_size=TP),
    # Merged windows of 2x2 tokens (28 px); layer 1 attends to the whole image.
    "qwen2_5_vl": dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=40,
                       out_hidden_size=48, patch_size=P, spatial_merge_size=M,
                       temporal_patch_size=TP, window_size=28, fullatt_block_indexes=[1]),
}
# Resized to 84x42 (ragged windows: 6x3 merged tokens) and 28x112 (2x8: whole windows).
SIZES = [(90, 50), (40, 130)]


def _save_random(family: str, path: Path) -> tuple[Any, dict]:
    """A random tiny model, norms ~N(1, 0.2) and every other parameter ~N(0, 0.2) so that
    biases and norm weights all matter; saved as safetensors."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(vision_config=VISION[family], text_config=TEXT)
        hf = tf.Qwen2VLForConditionalGeneration(cfg).eval()
    else:
        cfg = tf.Qwen2_5_VLConfig(vision_config=VISION[family], text_config=TEXT)
        hf = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if ("norm" in name or "ln_q" in name) and p.dim() == 1 else 0.0, 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module", params=list(VISION))
def tiny(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, dict]:
    path = tmp_path_factory.mktemp(request.param)
    hf, config = _save_random(request.param, path)
    return hf, path, config


@pytest.fixture(scope="module")
def processed() -> dict[str, torch.Tensor]:
    """Two random non-square PIL images through HF's PIL Qwen2-VL processor."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=P, merge_size=M, temporal_patch_size=TP,
                                    min_pixels=14 * 14 * 4, max_pixels=14 * 14 * 20)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return dict(proc(images, return_tensors="pt"))


def _encoder(config: dict, dtype: torch.dtype = torch.float32,
             device: torch.device = CPU) -> Qwen2VisionEncoder:
    return Qwen2VisionEncoder.from_hf_config(config, dtype, device)


def _vision_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tower and merger tensors, under the names transformers 5 saves."""
    return {n: t[:] for n, t in iter_safetensors(path) if n.startswith("visual.")}


def _reflatten(image: torch.Tensor) -> torch.Tensor:
    """The processor's ``flatten_patches`` for one ``[C, H, W]`` image (its own steps)."""
    c, h, w = image.shape
    x = image[None].repeat(TP, 1, 1, 1)
    x = x.reshape(1, TP, c, h // P // M, M, P, w // P // M, M, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape((h // P) * (w // P), c * TP * P * P)


def test_transformers_5_saves_the_tower_under_visual(tiny: tuple[Any, Path, dict]) -> None:
    names = {n for n, _ in iter_safetensors(tiny[1])}
    assert "visual.merger.mlp.2.weight" in names
    assert not any(n.startswith("model.visual.") for n in names)


def test_patches_to_images_round_trips(processed: dict[str, torch.Tensor]) -> None:
    pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    images = patches_to_images(pixels, grid, P, TP, M)
    assert [tuple(i.shape) for i in images] == [(3, 84, 42), (3, 28, 112)]
    assert grid.tolist() == [[1, 12, 6], [1, 4, 16]]
    assert torch.equal(torch.cat([_reflatten(i) for i in images]), pixels)
    assert [image_grid(*i.shape[1:], P, M) for i in images] == [(6, 3), (2, 8)]


def test_fp32_encoder_matches_hf_visual(tiny: tuple[Any, Path, dict],
                                        processed: dict[str, torch.Tensor]) -> None:
    hf, path, config = tiny
    enc = _encoder(config)
    enc.load_weights(iter_safetensors(path))
    pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid).pooler_output
    refs = ref.split([h * w // M ** 2 for _, h, w in grid.tolist()])
    for image, expected in zip(patches_to_images(pixels, grid, P, TP, M), refs, strict=True):
        with torch.inference_mode():
            ours = enc(image[None])
        assert ours.dtype == torch.float32
        assert ours.shape == (1, expected.shape[0], 48)
        torch.testing.assert_close(ours[0], expected, atol=1e-5, rtol=1e-4)


def _video_patches(frames: torch.Tensor) -> torch.Tensor:
    """HF's video processor's ``patchify`` of ``[T, C, H, W]`` frames (its own steps)."""
    t, c, h, w = frames.shape
    x = frames.reshape(1, t // TP, TP, c, h // P // M, M, P, w // P // M, M, P)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape((t // TP) * (h // P) * (w // P), c * TP * P * P)


@pytest.mark.parametrize("size", [(42, 84), (56, 28)], ids=["ragged-windows", "small"])
def test_fp32_video_encoder_matches_hf_visual(tiny: tuple[Any, Path, dict],
                                              size: tuple[int, int]) -> None:
    """Six frames (three temporal slices) through ``encode_video`` = HF's ``visual`` on the
    video processor's patches and ``video_grid_thw``: slices attend apart, frames in one
    slice meet only in the Conv3d (so swapping two frames of a slice changes the output)."""
    hf, path, config = tiny
    enc = _encoder(config)
    enc.load_weights(iter_safetensors(path))
    frames = torch.randn(6, 3, *size, generator=torch.Generator().manual_seed(3))
    grid = torch.tensor([[3, size[0] // P, size[1] // P]])
    with torch.no_grad():
        ref = hf.model.visual(_video_patches(frames), grid_thw=grid).pooler_output
    with torch.inference_mode():
        ours = enc.encode_video(frames)
        swapped = enc.encode_video(frames[[1, 0, 2, 3, 4, 5]])
    assert ours.shape == (3 * size[0] * size[1] // (P * M) ** 2, 48)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    n = ours.shape[0] // 3
    assert not torch.allclose(swapped[:n], ours[:n])
    torch.testing.assert_close(swapped[n:], ours[n:])


@pytest.mark.parametrize("shape", [(3, 3, 28, 28), (2, 3, 28, 30), (0, 3, 28, 28),
                                   (2, 1, 28, 28), (3, 28, 28)])
def test_bad_video_shape_raises(tiny: tuple[Any, Path, dict], shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"video frames shape \(" + ", ".join(map(str, shape))):
        _encoder(tiny[2]).encode_video(torch.zeros(shape))


@pytest.mark.parametrize("shape", [(1, 3, 28, 30), (1, 3, 21, 28), (2, 3, 28, 28),
                                   (1, 1, 28, 28), (3, 28, 28), (1, 3, 0, 28)])
def test_bad_pixel_shape_raises(tiny: tuple[Any, Path, dict], shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"pixel_values shape \(" + ", ".join(map(str, shape))):
        _encoder(tiny[2])(torch.zeros(shape))


def test_both_saved_layouts_load_the_same_weights(tiny: tuple[Any, Path, dict],
                                                  tmp_path: Path) -> None:
    """Older saves (``visual.``) and transformers 5 in memory (``model.visual.``), beside
    text decoder names, which are skipped."""
    _, path, config = tiny
    tensors = _vision_tensors(path)
    save_file({"model.language_model.norm.weight": torch.zeros(48),
               "model.norm.weight": torch.zeros(48), "lm_head.weight": torch.zeros(300, 48),
               **{f"model.{n}": t for n, t in tensors.items()}},
              str(tmp_path / "model.safetensors"))
    base, renamed = _encoder(config), _encoder(config)
    base.load_weights(iter_safetensors(path))
    renamed.load_weights(iter_safetensors(tmp_path))
    for (name, a), b in zip(base.state_dict().items(), renamed.state_dict().values()):
        assert torch.equal(a, b), name


def test_missing_tensor_raises_naming_it(tiny: tuple[Any, Path, dict]) -> None:
    _, path, config = tiny
    name = ("visual.blocks.2.mlp.up_proj.bias" if config["model_type"] == "qwen2_5_vl"
            else "visual.blocks.2.norm1.bias")
    tensors = _vision_tensors(path)
    del tensors[name]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _encoder(config).load_weights(tensors.items())


@pytest.mark.parametrize("name", ["visual.probe.weight", "model.visual.blocks.3.attn.qkv.bias"])
def test_unknown_vision_name_raises(tiny: tuple[Any, Path, dict], name: str) -> None:
    _, path, config = tiny
    tensors = _vision_tensors(path)
    tensors[name] = torch.zeros(32)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _encoder(config).load_weights(tensors.items())


def test_wrong_shape_raises_naming_the_tensor(tiny: tuple[Any, Path, dict]) -> None:
    _, path, config = tiny
    tensors = _vision_tensors(path)
    tensors["visual.blocks.1.attn.qkv.weight"] = torch.zeros(96, 31)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight.*\(96, 31\).*\(96, 32\)"):
        _encoder(config).load_weights(tensors.items())


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(model_type="llava"), "model_type"),
    (lambda c: c.pop("vision_config"), "vision_config"),
    (lambda c: c["vision_config"].update(model_type="siglip_vision_model"),
     "vision_config.model_type"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
    (lambda c: c["vision_config"].update(num_heads=3), "num_heads"),
    (lambda c: c["vision_config"].update(num_heads=16), "multiple of 4"),
    (lambda c: c["vision_config"].update(patch_size=0), "vision_config.patch_size"),
    (lambda c: c["vision_config"].update(depth="3"), "vision_config.depth"),
    (lambda c: c["vision_config"].update(rope_parameters={"rope_type": "yarn"}),
     "vision_config.rope_parameters"),
    (lambda c: c["text_config"].update(hidden_size=64), "merger's width"),
])
def test_unsupported_config_raises_naming_the_field(
        tiny: tuple[Any, Path, dict], edit: Any, field: str) -> None:
    config = json.loads(json.dumps(tiny[2]))
    edit(config)
    with pytest.raises(ValueError, match=field):
        _encoder(config)


@pytest.mark.parametrize("edit, field", [
    (lambda v: v.update(window_size=13), "vision_config.window_size"),
    (lambda v: v.update(fullatt_block_indexes=[3]), "vision_config.fullatt_block_indexes"),
    (lambda v: v.update(fullatt_block_indexes="1"), "vision_config.fullatt_block_indexes"),
    (lambda v: v.update(out_hidden_size=-1), "vision_config.out_hidden_size"),
])
def test_unsupported_qwen2_5_config_raises_naming_the_field(edit: Any, field: str) -> None:
    vision = dict(VISION["qwen2_5_vl"])
    edit(vision)
    with pytest.raises(ValueError, match=field):
        _encoder({"model_type": "qwen2_5_vl", "vision_config": vision})


def test_released_configs_get_the_config_classes_defaults() -> None:
    """Qwen2-VL-7B-Instruct's and Qwen2.5-VL-7B-Instruct's config.json (flat text fields;
    the vision config lists only what differs from the defaults, under older names)."""
    meta = torch.device("meta")
    v2 = _encoder({"model_type": "qwen2_vl", "hidden_size": 3584,
                   "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4,
                                     "num_heads": 16, "in_chans": 3, "hidden_size": 3584,
                                     "patch_size": 14, "spatial_merge_size": 2,
                                     "spatial_patch_size": 14, "temporal_patch_size": 2}},
                  torch.bfloat16, meta)
    assert v2.cfg.hidden_act == "quick_gelu" and v2.cfg.rope_theta == 10000.0
    assert v2.blocks[0].up_weight.shape == (5120, 1280) and v2.blocks[0].norm1_bias is not None
    assert v2.patch_weight.shape == (1280, 3, 2, 14, 14) and v2.mlp2_weight.shape == (3584, 5120)
    v25 = _encoder({"model_type": "qwen2_5_vl", "hidden_size": 3584,
                    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                                      "intermediate_size": 3420, "num_heads": 16,
                                      "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                                      "spatial_merge_size": 2, "spatial_patch_size": 14,
                                      "window_size": 112,
                                      "fullatt_block_indexes": [7, 15, 23, 31],
                                      "tokens_per_second": 2, "temporal_patch_size": 2}},
                   torch.bfloat16, meta)
    assert v25.cfg.merger_window == 4 and v25.cfg.fullatt_blocks == (7, 15, 23, 31)
    assert v25.blocks[0].up_weight.shape == (6840, 1280) and v25.blocks[0].norm1_bias is None
    assert v25.mlp2_weight.shape == (3584, 5120) and v25.ln_q_bias is None


def test_image_grid_rejects_unmerged_sizes() -> None:
    assert image_grid(84, 42, P, M) == (6, 3)
    with pytest.raises(ValueError, match="multiple of"):
        image_grid(84, 40, P, M)
