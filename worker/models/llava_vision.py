"""LLaVA-1.5's image encoder: the CLIP vision tower and LLaVA's multimodal projector.

``encoder(pixel_values)`` is Hugging Face's ``get_image_features(...).pooler_output``
stacked: a bias-free patch Conv2d behind a learned class token, learned positions, the
``pre_layrnorm``, pre-LayerNorm encoder layers with bidirectional multi-head attention (q/k/v
fused into one matmul), the hidden states after ``vision_feature_layer`` layers (the CLS
token dropped under strategy ``default``), then ``linear_2(act(linear_1(x)))``. CLIP's
``post_layernorm`` only feeds the pooled output, which LLaVA never reads, and the layers
after the feature layer are loaded but never run. LLaVA-OneVision's SigLIP tower is the
same less the class token and the pre-norm, its patch Conv2d with a bias. Plain torch: no
transformers at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.models.vit import (
    ACTIVATIONS,
    EncoderLayer,
    TowerConfig,
    load_targets,
    param,
    positive_int,
)

_STRATEGIES = ("default", "full")
LLAVA_FAMILIES = ("llava", "llava_next", "llava_onevision")
# Saved beside the tower but unused: the pooled-output norm (CLIP's, SigLIP's), SigLIP's
# pooling head and the position ids buffer.
_IGNORED = ("vision_tower.post_layernorm.", "vision_tower.embeddings.position_ids",
            "vision_tower.head.")


@dataclass(frozen=True)
class LlavaVisionConfig(TowerConfig):
    """CLIP's shape and LLaVA's feature selection and projector. ``feature_layers`` are ``vision_feature_layer``'s indices into the tower's
    ``num_layers + 1`` hidden states (one int, or a list whose states are concatenated)."""

    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    siglip: bool = False  # a SigLIP tower (LLaVA-OneVision): no class token, no pre-norm

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projector_act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {self.projector_act!r} is not one of "
                             f"{sorted(ACTIVATIONS)}")
        n = self.num_layers + 1
        if not self.feature_layers or any(not -n <= i < n for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer {list(self.feature_layers)} is not a "
                             f"non-empty list of indices into the tower's {n} hidden states")
        if self.select_strategy not in _STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} is not "
                             f"one of {list(_STRATEGIES)}")

    @property
    def depths(self) -> tuple[int, ...]:
        """How many encoder layers precede each selected hidden state (0: the embeddings)."""
        return tuple(i % (self.num_layers + 1) for i in self.feature_layers)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, hf_config: dict) -> LlavaVisionConfig:
        """Read a ``llava`` (or ``llava_next``) config.json dict. Released files list only the fields that
        differ from the config classes' defaults (llava-1.5-7b-hf's ``text_config`` has no
        ``hidden_size``), so those defaults fill in the rest."""
        from transformers import AutoConfig, CLIPVisionConfig, SiglipVisionConfig

        family = hf_config.get("model_type")
        if family not in LLAVA_FAMILIES:
            raise ValueError(f"model_type {family!r} is not one of {LLAVA_FAMILIES}")
        onevision = family == "llava_onevision"
        vision = hf_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError("vision_config is missing or not a dict")
        kind = vision.get("model_type", "siglip_vision_model" if onevision
                          else "clip_vision_model")
        if kind not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"vision_config.model_type {kind!r} is not 'clip_vision_model' "
                             "or 'siglip_vision_model'")
        siglip = kind == "siglip_vision_model"
        vision = {**(SiglipVisionConfig() if siglip else CLIPVisionConfig()).to_dict(), **vision}
        text = dict(hf_config.get("text_config") or {})
        if "hidden_size" not in text:
            try:
                text["hidden_size"] = AutoConfig.for_model(
                    text.get("model_type", "qwen2" if onevision else "llama")).hidden_size
            except (KeyError, ValueError) as e:
                raise ValueError(f"text_config.model_type is not a known model: {e}") from e
        layer = hf_config.get("vision_feature_layer", -1 if onevision else -2)
        layers = tuple(layer) if isinstance(layer, list | tuple) else (layer,)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise ValueError(f"vision_feature_layer {layer!r} is not an int or a list of ints")
        bias = hf_config.get("multimodal_projector_bias", True)
        if not isinstance(bias, bool):
            raise ValueError(f"multimodal_projector_bias {bias!r} is not a bool")
        return cls(
            hidden_size=positive_int(vision, "hidden_size", "vision_config"),
            intermediate_size=positive_int(vision, "intermediate_size", "vision_config"),
            num_layers=positive_int(vision, "num_hidden_layers", "vision_config"),
            num_heads=positive_int(vision, "num_attention_heads", "vision_config"),
            num_channels=positive_int(vision, "num_channels", "vision_config"),
            image_size=positive_int(vision, "image_size", "vision_config"),
            patch_size=positive_int(vision, "patch_size", "vision_config"),
            layer_norm_eps=float(vision["layer_norm_eps"]),
            hidden_act=str(vision["hidden_act"]),
            feature_layers=layers,
            select_strategy=str(hf_config.get("vision_feature_select_strategy",
                                              "full" if onevision else "default")),
            projector_act=str(hf_config.get("projector_hidden_act", "gelu")),
            projector_bias=bias,
            text_hidden_size=positive_int(text, "hidden_size", "text_config"),
            siglip=siglip,
        )


class LlavaVisionEncoder(nn.Module):
    """Pixels ``[N, 3, S, S]`` -> image tokens ``[N, tokens_per_image, text_hidden]``."""

    def __init__(self, cfg: LlavaVisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, c, ps, t = cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.text_hidden_size
        p = functools.partial(param, dtype=dtype, device=device)
        self.cfg, self.act = cfg, ACTIVATIONS[cfg.projector_act]
        cls_token = not cfg.siglip  # CLIP's class token (and pre-norm); SigLIP has neither
        self.tokens_per_image = cfg.num_patches + cls_token - (cfg.select_strategy == "default")
        self.image_size = cfg.image_size
        self.patch_weight = p(h, c, ps, ps)
        self.patch_bias = p(h) if cfg.siglip else None
        self.class_embedding = p(h) if cls_token else None
        self.position_embedding = p(cfg.num_patches + cls_token, h)
        self.pre_ln_weight, self.pre_ln_bias = (p(h), p(h)) if cls_token else (None, None)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype, device)
                                    for _ in range(cfg.num_layers))
        self.linear_1_weight = p(t, h * len(cfg.feature_layers))
        self.linear_2_weight = p(t, t)
        self.linear_1_bias = p(t) if cfg.projector_bias else None
        self.linear_2_bias = p(t) if cfg.projector_bias else None

    @classmethod
    def from_hf_config(cls, hf_config: dict, dtype: torch.dtype,
                       device: torch.device) -> LlavaVisionEncoder:
        """Build from the config.json dict (``model_type`` ``llava``), so the serving
        config needs no transformers objects; ValueError names a bad field."""
        return cls(LlavaVisionConfig.from_hf(hf_config), dtype, device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, tokens_per_image, text_hidden]`` in the encoder's dtype
        (pixels are cast to it first, as HF does); ValueError if ``S != image_size``, since
        the learned positions cover exactly one grid (HF's interpolation is not done).
        Only the layers up to the deepest feature layer run."""
        cfg, w = self.cfg, self.patch_weight
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} is not "
                             f"[N, {', '.join(map(str, expected))}] (image_size {cfg.image_size})")
        x = F.conv2d(pixel_values.to(device=w.device, dtype=w.dtype), w, self.patch_bias,
                     stride=cfg.patch_size).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.position_embedding
        if self.pre_ln_weight is not None:
            x = F.layer_norm(x, (cfg.hidden_size,), self.pre_ln_weight, self.pre_ln_bias,
                             cfg.layer_norm_eps)
        depths = cfg.depths
        picked = {0: x}
        for i, layer in enumerate(self.layers[:max(depths)], start=1):
            x = layer(x)
            if i in depths:
                picked[i] = x
        feats = torch.cat([picked[d] for d in depths], dim=-1)
        if cfg.select_strategy == "default":
            feats = feats[:, 1:]
        y = self.act(F.linear(feats, self.linear_1_weight, self.linear_1_bias))
        return F.linear(y, self.linear_2_weight, self.linear_2_bias)

    def _targets(self) -> dict[str, torch.Tensor]:
        optional = {"vision_tower.embeddings.class_embedding": self.class_embedding,
                    "vision_tower.embeddings.patch_embedding.bias": self.patch_bias,
                    "vision_tower.pre_layrnorm.weight": self.pre_ln_weight,
                    "vision_tower.pre_layrnorm.bias": self.pre_ln_bias}
        out = {"vision_tower.embeddings.patch_embedding.weight": self.patch_weight,
               "vision_tower.embeddings.position_embedding.weight": self.position_embedding,
               **{k: v for k, v in optional.items() if v is not None}}
        for j in (1, 2):
            out[f"multi_modal_projector.linear_{j}.weight"] = getattr(self, f"linear_{j}_weight")
            bias = getattr(self, f"linear_{j}_bias")
            if bias is not None:
                out[f"multi_modal_projector.linear_{j}.bias"] = bias
        for i, layer in enumerate(self.layers):
            out.update(layer.targets(f"vision_tower.encoder.layers.{i}."))
        return out

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Copy the tower's and projector's tensors from a whole multimodal checkpoint
        (any saved layout; the text decoder's names are skipped, so one pass over the
        file can feed both models). ValueError on a bad shape, an unknown vision name, or
        a parameter the checkpoint did not provide (every layer's included, run or not)."""
        load_targets(self._targets(), weights, "LLaVA vision tower / projector", _IGNORED)
