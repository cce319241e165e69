"""LLaVA-1.5's image encoder against Hugging Face's ``get_image_features`` on a tiny random model."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.worker.loaders.hf import iter_safetensors
from pagedserve.worker.models.llava_vision import LlavaVisionEncoder

CPU = torch.device("cpu")
VISION = dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=3,
              num_attention_heads=4, intermediate_size=64, image_size=28, patch_size=7,
              hidden_act="quick_gelu")
TEXT = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, vocab_size=300)


def _save_random(path: Path, **top: Any) -> tuple[Any, dict]:
    """A random tiny LLaVA, norms ~N(1, 0.2) and every other parameter ~N(0, 0.2) so that
    biases, the class token and the ``pre_layrnorm`` all matter; saved as safetensors."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlavaConfig(vision_config=VISION, text_config=TEXT, image_token_index=299, **top)
    hf = tf.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name and p.dim() == 1 else 0.0, 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, dict]:
    path = tmp_path_factory.mktemp("llava_vision")
    hf, config = _save_random(path)
    return hf, path, config


def _encoder(config: dict, dtype: torch.dtype = torch.float32,
             device: torch.device = CPU) -> LlavaVisionEncoder:
    return LlavaVisionEncoder.from_hf_config(config, dtype, device)


def _reference(hf: Any, pixels: torch.Tensor, layer: Any = -2,
               strategy: str = "default") -> torch.Tensor:
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, vision_feature_layer=layer,
                                          vision_feature_select_strategy=strategy)
    return torch.stack(list(out.pooler_output))


def _vision_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's vision and projector tensors, under the names transformers 5 saves."""
    return {n: t[:] for n, t in iter_safetensors(path)
            if n.startswith(("vision_tower.", "multi_modal_projector."))}


def test_transformers_5_saves_the_tower_without_model_or_vision_model(
        tiny: tuple[Any, Path, dict]) -> None:
    names = set(_vision_tensors(tiny[1]))
    assert "vision_tower.pre_layrnorm.weight" in names
    assert "vision_tower.post_layernorm.weight" in names


@pytest.mark.parametrize("layer", [-2, -1, -4, 1])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_fp32_encoder_matches_hf_image_features(
        tiny: tuple[Any, Path, dict], layer: int, strategy: str) -> None:
    hf, path, config = tiny
    enc = _encoder({**config, "vision_feature_layer": layer,
                    "vision_feature_select_strategy": strategy})
    enc.load_weights(iter_safetensors(path))
    pixels = torch.randn(2, 3, 28, 28)
    with torch.inference_mode():
        ours = enc(pixels)
    ref = _reference(hf, pixels, layer, strategy)
    tokens = 16 + (strategy == "full")
    assert (enc.tokens_per_image, enc.image_size) == (tokens, 28)
    assert ours.shape == ref.shape == (2, tokens, 64) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-5


def test_layers_past_the_feature_layer_are_loaded_but_never_run(
        tiny: tuple[Any, Path, dict]) -> None:
    hf, path, config = tiny
    enc = _encoder(config)
    tensors = _vision_tensors(path)
    tensors["vision_tower.encoder.layers.2.mlp.fc1.weight"] = torch.full((64, 32), float("nan"))
    enc.load_weights(tensors.items())
    assert enc.layers[2].fc1_weight.isnan().all()
    pixels = torch.randn(1, 3, 28, 28)
    torch.testing.assert_close(enc(pixels), _reference(hf, pixels), atol=1e-5, rtol=0)


def test_feature_layer_list_full_strategy_and_no_projector_bias(tmp_path: Path) -> None:
    """A list of feature layers concatenates their states (linear_1 widens to match)."""
    hf, config = _save_random(tmp_path, vision_feature_layer=[-3, 0, -1],
                              vision_feature_select_strategy="full",
                              multimodal_projector_bias=False)
    enc = _encoder(config)
    enc.load_weights(iter_safetensors(tmp_path))
    assert enc.linear_1_weight.shape == (64, 96) and enc.linear_1_bias is None
    pixels = torch.randn(2, 3, 28, 28)
    ref = _reference(hf, pixels, [-3, 0, -1], "full")
    assert ref.shape == (2, 17, 64)
    assert (enc(pixels) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rename", [
    lambda n: n.replace("vision_tower.", "vision_tower.vision_model."),
    lambda n: "model." + n.replace("vision_tower.", "vision_tower.vision_model."),
    lambda n: "model." + n,
], ids=["released", "model-prefixed-vision-model", "model-prefixed"])
def test_every_saved_name_layout_loads_the_same_weights(
        tiny: tuple[Any, Path, dict], rename: Any) -> None:
    _, path, config = tiny
    base, renamed = _encoder(config), _encoder(config)
    base.load_weights(iter_safetensors(path))
    tensors = _vision_tensors(path)
    tensors["vision_tower.embeddings.position_ids"] = torch.arange(17)[None]
    extra = [("language_model.model.norm.weight", torch.zeros(64)),
             ("model.language_model.norm.weight", torch.zeros(64)),
             ("lm_head.weight", torch.zeros(300, 64))]
    renamed.load_weights([*extra, *((rename(n), t) for n, t in tensors.items())])
    for (name, a), b in zip(base.state_dict().items(), renamed.state_dict().values()):
        assert torch.equal(a, b), name


def test_wrong_shape_raises_naming_the_tensor(tiny: tuple[Any, Path, dict]) -> None:
    _, path, config = tiny
    bad = "vision_tower.encoder.layers.1.mlp.fc1.weight"
    tensors = _vision_tensors(path)
    tensors[bad] = torch.zeros(64, 31)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.fc1\.weight.*\(64, 31\).*\(64, 32\)"):
        _encoder(config).load_weights(tensors.items())


@pytest.mark.parametrize("name", ["multi_modal_projector.linear_2.bias",
                                  "vision_tower.embeddings.class_embedding",
                                  "vision_tower.encoder.layers.2.self_attn.k_proj.weight"])
def test_missing_parameter_raises(tiny: tuple[Any, Path, dict], name: str) -> None:
    _, path, config = tiny
    tensors = _vision_tensors(path)
    del tensors[name]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _encoder(config).load_weights(tensors.items())


@pytest.mark.parametrize("name", ["vision_tower.probe.weight",
                                  "vision_tower.embeddings.patch_embedding.bias",
                                  "model.multi_modal_projector.linear_3.weight"])
def test_unknown_vision_name_raises(tiny: tuple[Any, Path, dict], name: str) -> None:
    _, path, config = tiny
    tensors = _vision_tensors(path)
    tensors[name] = torch.zeros(32)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _encoder(config).load_weights(tensors.items())


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(model_type="gemma3"), "model_type"),
    (lambda c: c.pop("vision_config"), "vision_config"),
    (lambda c: c["vision_config"].update(model_type="dinov2"),
     "vision_config.model_type"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
    (lambda c: c["vision_config"].update(num_attention_heads=5), "num_attention_heads"),
    (lambda c: c["vision_config"].update(patch_size=5), "patch_size"),
    (lambda c: c["vision_config"].update(hidden_size=0), "vision_config.hidden_size"),
    (lambda c: c["text_config"].update(hidden_size="64"), "text_config.hidden_size"),
    (lambda c: c.update(text_config={"model_type": "no_such_model"}), "text_config.model_type"),
    (lambda c: c.update(vision_feature_layer=4), "vision_feature_layer"),
    (lambda c: c.update(vision_feature_layer=-5), "vision_feature_layer"),
    (lambda c: c.update(vision_feature_layer="-2"), "vision_feature_layer"),
    (lambda c: c.update(vision_feature_layer=[]), "vision_feature_layer"),
    (lambda c: c.update(vision_feature_select_strategy="cls"), "vision_feature_select_strategy"),
    (lambda c: c.update(projector_hidden_act="relu"), "projector_hidden_act"),
    (lambda c: c.update(multimodal_projector_bias="yes"), "multimodal_projector_bias"),
])
def test_unsupported_config_raises_naming_the_field(
        tiny: tuple[Any, Path, dict], edit: Any, field: str) -> None:
    config = json.loads(json.dumps(tiny[2]))
    edit(config)
    with pytest.raises(ValueError, match=field):
        _encoder(config)


def test_released_llava_1_5_config_gets_the_config_classes_defaults() -> None:
    """llava-hf/llava-1.5-7b-hf's config.json: no text hidden_size, no feature-layer keys."""
    config = {"model_type": "llava", "image_token_index": 32000,
              "text_config": {"model_type": "llama", "vocab_size": 32064},
              "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                                "model_type": "clip_vision_model", "num_attention_heads": 16,
                                "num_hidden_layers": 24, "patch_size": 14,
                                "projection_dim": 768, "vocab_size": 32000}}
    enc = _encoder(config, torch.float16, torch.device("meta"))
    assert (enc.tokens_per_image, enc.image_size) == (576, 336)
    assert enc.cfg.depths == (23,) and enc.cfg.hidden_act == "quick_gelu"
    assert enc.linear_1_weight.shape == (4096, 1024) and enc.linear_2_bias.shape == (4096,)
    assert enc.cfg.projector_act == "gelu" and enc.cfg.layer_norm_eps == 1e-5
    full = _encoder({**config, "vision_feature_select_strategy": "full"}, torch.float16,
                    torch.device("meta"))
    assert full.tokens_per_image == 577


def test_wrong_image_size_raises(tiny: tuple[Any, Path, dict]) -> None:
    enc = _encoder(tiny[2])
    with pytest.raises(ValueError, match="image_size 28"):
        enc(torch.randn(1, 3, 35, 35))


def test_bf16_encoder_is_close_to_hf(tiny: tuple[Any, Path, dict]) -> None:
    """bf16 keeps 8 mantissa bits: against fp32 HF the tokens (max |x| ~18, where a bf16 step
    is 0.125) are off by ~0.15, so 2% of the largest is allowed; against HF run in bf16 (same
    casts, same op order) they match bit for bit on CPU, and 1% is allowed."""
    hf, path, config = tiny
    enc = _encoder(config, torch.bfloat16)
    enc.load_weights(iter_safetensors(path))
    pixels = torch.randn(2, 3, 28, 28)
    with torch.inference_mode():
        out = enc(pixels)
    assert out.dtype == torch.bfloat16
    ours = out.float()
    ref = _reference(hf, pixels)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 0.02 * scale
    ref_bf16 = _reference(copy.deepcopy(hf).to(torch.bfloat16), pixels).float()
    assert (ours - ref_bf16).abs().max().item() <= 0.01 * scale


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_a_siglip_tower_matches_hf_image_features(tmp_path: Path, strategy: str) -> None:
    """LLaVA over SigLIP (LLaVA-OneVision's tower; plain LLaVA files may hold one too):
    a patch Conv2d with a bias, no class token, no pre-norm, the pooling head unread."""
    import transformers as tf

    siglip = dict(VISION, model_type="siglip_vision_model", hidden_act="gelu_pytorch_tanh")
    torch.manual_seed(1)
    hf = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=siglip, text_config=TEXT, image_token_index=299)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name and p.dim() == 1 else 0.0, 0.2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    enc = _encoder({**config, "vision_feature_select_strategy": strategy})
    enc.load_weights(iter_safetensors(tmp_path))
    pixels = torch.randn(2, 3, 28, 28)
    want = _reference(hf, pixels, strategy=strategy)
    assert enc.tokens_per_image == want.shape[1] == 16 - (strategy == "default")
    torch.testing.assert_close(enc(pixels), want, rtol=0, atol=1e-5)
