"""Gemma 3's image encoder against Hugging Face's ``get_image_features`` on a tiny random model."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.worker.loaders.hf import iter_safetensors
from pagedserve.worker.models.gemma3_vision import Gemma3VisionEncoder

CPU = torch.device("cpu")
VISION = dict(model_type="siglip_vision_model", hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=64, image_size=28, patch_size=7,
              vision_use_head=False)
TEXT = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, dict]:
    """A random tiny Gemma 3 (16 patches pooled to 4 tokens), every parameter ~N(0, 0.2) so
    the norms' ``1 + w`` and all biases matter; saved as safetensors."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma3Config(vision_config=VISION, text_config=TEXT, mm_tokens_per_image=4)
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("gemma3_vision")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path, json.loads((path / "config.json").read_text())


def _encoder(config: dict, dtype: torch.dtype = torch.float32) -> Gemma3VisionEncoder:
    return Gemma3VisionEncoder.from_hf_config(config, dtype, CPU)


def _reference(hf: Any, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.get_image_features(pixels).pooler_output


def _vision_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's vision and projector tensors, under the names transformers 5 saves."""
    return {n: t[:] for n, t in iter_safetensors(path)
            if n.startswith(("vision_tower.", "multi_modal_projector."))}


def test_fp32_encoder_matches_hf_image_features(tiny: tuple[Any, Path, dict]) -> None:
    hf, path, config = tiny
    enc = _encoder(config)
    enc.load_weights(iter_safetensors(path))
    pixels = torch.randn(2, 3, 28, 28)
    with torch.inference_mode():
        ours = enc(pixels)
    ref = _reference(hf, pixels)
    assert (enc.tokens_per_image, enc.image_size) == (4, 28)
    assert ours.shape == ref.shape == (2, 4, 64) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rename", [
    lambda n: n.replace("vision_tower.", "vision_tower.vision_model."),
    lambda n: "model." + n.replace("vision_tower.", "vision_tower.vision_model."),
    lambda n: "model." + n,
], ids=["released", "model-prefixed-4.5x", "model-prefixed"])
def test_every_saved_name_layout_loads_the_same_weights(
        tiny: tuple[Any, Path, dict], rename: Any) -> None:
    _, path, config = tiny
    base, renamed = _encoder(config), _encoder(config)
    base.load_weights(iter_safetensors(path))
    tensors = _vision_tensors(path)
    renamed.load_weights([("language_model.model.norm.weight", torch.zeros(64)),
                          *((rename(n), t) for n, t in tensors.items())])
    for (name, a), b in zip(base.state_dict().items(), renamed.state_dict().values()):
        assert torch.equal(a, b), name


def test_wrong_shape_raises_naming_the_tensor(tiny: tuple[Any, Path, dict]) -> None:
    _, path, config = tiny
    bad = "vision_tower.encoder.layers.1.mlp.fc1.weight"
    tensors = _vision_tensors(path)
    tensors[bad] = torch.zeros(64, 31)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.fc1\.weight.*\(64, 31\).*\(64, 32\)"):
        _encoder(config).load_weights(tensors.items())


def test_missing_parameter_raises(tiny: tuple[Any, Path, dict]) -> None:
    _, path, config = tiny
    tensors = _vision_tensors(path)
    del tensors["multi_modal_projector.mm_soft_emb_norm.weight"]
    with pytest.raises(ValueError, match="mm_soft_emb_norm"):
        _encoder(config).load_weights(tensors.items())


def test_unknown_vision_name_raises(tiny: tuple[Any, Path, dict]) -> None:
    _, path, config = tiny
    tensors = _vision_tensors(path)
    tensors["vision_tower.probe.weight"] = torch.zeros(1, 1, 32)
    with pytest.raises(ValueError, match=r"vision_tower\.probe"):
        _encoder(config).load_weights(tensors.items())


def test_a_siglip_pooling_head_is_skipped(tiny: tuple[Any, Path, dict]) -> None:
    """A tower saved with SigLIP's pooling head (``vision_use_head``, SigLIP's default)
    loads: Gemma 3 reads the tower's last hidden states, never the head's output."""
    hf, path, config = tiny
    config = json.loads(json.dumps(config))
    config["vision_config"]["vision_use_head"] = True
    tensors = _vision_tensors(path)
    tensors["vision_tower.head.probe"] = torch.zeros(1, 1, 32)
    enc = _encoder(config)
    enc.load_weights(tensors.items())
    pixels = torch.randn(1, 3, 28, 28)
    want = hf.model.get_image_features(pixels).pooler_output
    torch.testing.assert_close(enc(pixels), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["text_config"].pop("hidden_size"), "text_config.hidden_size"),
    (lambda c: c.pop("vision_config"), "vision_config"),
    (lambda c: c.update(mm_tokens_per_image=8), "mm_tokens_per_image"),
    (lambda c: c.update(mm_tokens_per_image=9), "mm_tokens_per_image"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "hidden_act"),
    (lambda c: c["vision_config"].update(num_attention_heads=5), "num_attention_heads"),
    (lambda c: c.update(model_type="paligemma"), "model_type"),
])
def test_unsupported_config_raises_naming_the_field(
        tiny: tuple[Any, Path, dict], edit: Any, field: str) -> None:
    config = json.loads(json.dumps(tiny[2]))
    edit(config)
    with pytest.raises(ValueError, match=field):
        _encoder(config)


def test_default_mm_tokens_per_image_is_256() -> None:
    config = {"model_type": "gemma3", "text_config": {"hidden_size": 64},
              "vision_config": {**VISION, "image_size": 224, "patch_size": 14}}
    assert _encoder(config).tokens_per_image == 256


def test_wrong_image_size_raises(tiny: tuple[Any, Path, dict]) -> None:
    enc = _encoder(tiny[2])
    with pytest.raises(ValueError, match="image_size 28"):
        enc(torch.randn(1, 3, 35, 35))


def test_bf16_encoder_is_close_to_hf(tiny: tuple[Any, Path, dict]) -> None:
    """bf16 keeps 8 mantissa bits: against fp32 HF the soft tokens (max |x| ~3.4) are off by
    ~0.016, so 0.05 is allowed; against HF run in bf16 (same casts, same op order) 1e-2."""
    hf, path, config = tiny
    enc = _encoder(config, torch.bfloat16)
    enc.load_weights(iter_safetensors(path))
    pixels = torch.randn(2, 3, 28, 28)
    with torch.inference_mode():
        out = enc(pixels)
    assert out.dtype == torch.bfloat16
    ours = out.float()
    assert (ours - _reference(hf, pixels)).abs().max().item() <= 0.05
    ref_bf16 = _reference(copy.deepcopy(hf).to(torch.bfloat16), pixels).float()
    assert (ours - ref_bf16).abs().max().item() <= 1e-2
