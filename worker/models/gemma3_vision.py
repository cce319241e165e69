"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector.

``encoder(pixel_values)`` is Hugging Face's ``get_image_features(...).pooler_output``:
a patch Conv2d plus learned positions, pre-LayerNorm encoder layers with bidirectional
multi-head attention (q/k/v fused into one matmul), a final LayerNorm, then the projector
(average-pool the patch grid to ``mm_tokens_per_image`` tokens, a ``1 + weight`` RMSNorm
in fp32, a matmul into the text model's width). Plain torch: no transformers at run time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.models.vit import (
    EncoderLayer,
    TowerConfig,
    load_targets,
    param,
    positive_int,
)


@dataclass(frozen=True)
class Gemma3VisionConfig(TowerConfig):
    """SigLIP's shape and Gemma's projector's: ``tokens_per_image`` pooled soft tokens
    into ``text_hidden_size``."""

    tokens_per_image: int
    text_hidden_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        side = math.isqrt(self.tokens_per_image)
        if side * side != self.tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image ({self.tokens_per_image}) is not a square "
                             f"whose side divides the {self.patches_per_side}-patch grid side")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool_kernel(self) -> int:
        return self.patches_per_side // math.isqrt(self.tokens_per_image)

    @classmethod
    def from_hf(cls, hf_config: dict) -> Gemma3VisionConfig:
        """Read a multimodal ``gemma3`` config.json dict; its ``vision_config`` lists only
        the fields that differ from SigLIP's defaults, so those fill in the rest."""
        from transformers import SiglipVisionConfig

        if hf_config.get("model_type") != "gemma3":
            raise ValueError(f"model_type {hf_config.get('model_type')!r} is not 'gemma3'")
        vision = hf_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError("vision_config is missing or not a dict")
        try:
            vision = SiglipVisionConfig(**vision).to_dict()
        except (TypeError, ValueError) as e:
            raise ValueError(f"vision_config is not a valid SiglipVisionConfig: {e}") from e
        text = hf_config.get("text_config")
        return cls(
            hidden_size=positive_int(vision, "hidden_size", "vision_config"),
            intermediate_size=positive_int(vision, "intermediate_size", "vision_config"),
            num_layers=positive_int(vision, "num_hidden_layers", "vision_config"),
            num_heads=positive_int(vision, "num_attention_heads", "vision_config"),
            num_channels=positive_int(vision, "num_channels", "vision_config"),
            image_size=_square(vision, "image_size"),
            patch_size=_square(vision, "patch_size"),
            layer_norm_eps=float(vision["layer_norm_eps"]),
            hidden_act=str(vision["hidden_act"]),
            tokens_per_image=positive_int({"mm_tokens_per_image": 256, **hf_config},
                                           "mm_tokens_per_image", ""),
            text_hidden_size=positive_int(text if isinstance(text, dict) else {},
                                           "hidden_size", "text_config"),
        )





def _square(vision: dict, key: str) -> int:
    """SigLIP allows ``[h, w]`` sizes; the projector's square pooling needs ``h == w``."""
    value = vision.get(key)
    if isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return positive_int({key: value}, key, "vision_config")





class Gemma3VisionEncoder(nn.Module):
    """Pixels ``[N, 3, S, S]`` -> soft tokens ``[N, mm_tokens_per_image, text_hidden]``."""

    def __init__(self, cfg: Gemma3VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, c, ps = cfg.hidden_size, cfg.num_channels, cfg.patch_size
        p = functools.partial(param, dtype=dtype, device=device)
        self.cfg = cfg
        self.tokens_per_image, self.image_size = cfg.tokens_per_image, cfg.image_size
        self.patch_weight, self.patch_bias = p(h, c, ps, ps), p(h)
        self.position_embedding = p(cfg.patches_per_side ** 2, h)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype, device)
                                    for _ in range(cfg.num_layers))
        self.post_ln_weight, self.post_ln_bias = p(h), p(h)
        self.mm_norm_weight = p(h)
        self.mm_projection = p(h, cfg.text_hidden_size)

    @classmethod
    def from_hf_config(cls, hf_config: dict, dtype: torch.dtype,
                       device: torch.device) -> Gemma3VisionEncoder:
        """Build from the multimodal config.json dict (``model_type`` ``gemma3``), so the
        serving config needs no transformers objects; ValueError names a bad field."""
        return cls(Gemma3VisionConfig.from_hf(hf_config), dtype, device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, tokens_per_image, text_hidden]`` in the encoder's dtype
        (pixels are cast to it first, as HF does); ValueError if ``S != image_size``, since
        the learned positions cover exactly one grid (HF's interpolation is not done)."""
        cfg, w = self.cfg, self.patch_weight
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} is not "
                             f"[N, {', '.join(map(str, expected))}] (image_size {cfg.image_size})")
        x = F.conv2d(pixel_values.to(device=w.device, dtype=w.dtype), w, self.patch_bias,
                     stride=cfg.patch_size)
        x = x.flatten(2).transpose(1, 2) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        x = F.layer_norm(x, (cfg.hidden_size,), self.post_ln_weight, self.post_ln_bias,
                         cfg.layer_norm_eps)
        return self._project(x)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """Pool the patch grid, RMSNorm in fp32 with ``1 + w``, then cast back to the
        encoder's dtype before the projection matmul (HF's order, so bf16 rounds the same)."""
        n, _, h = x.shape
        side = self.cfg.patches_per_side
        grid = x.view(n, side, side, h).permute(0, 3, 1, 2)  # channels-last: no copy
        pooled = F.avg_pool2d(grid, self.cfg.pool_kernel).permute(0, 2, 3, 1).reshape(n, -1, h)
        xf = pooled.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.layer_norm_eps)
        normed = (xf * (1.0 + self.mm_norm_weight.float())).to(x.dtype)
        return torch.matmul(normed, self.mm_projection)

    def _targets(self) -> dict[str, torch.Tensor]:
        out = {"vision_tower.embeddings.patch_embedding.weight": self.patch_weight,
               "vision_tower.embeddings.patch_embedding.bias": self.patch_bias,
               "vision_tower.embeddings.position_embedding.weight": self.position_embedding,
               "vision_tower.post_layernorm.weight": self.post_ln_weight,
               "vision_tower.post_layernorm.bias": self.post_ln_bias,
               "multi_modal_projector.mm_soft_emb_norm.weight": self.mm_norm_weight,
               "multi_modal_projector.mm_input_projection_weight": self.mm_projection}
        for i, layer in enumerate(self.layers):
            out.update(layer.targets(f"vision_tower.encoder.layers.{i}."))
        return out

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Copy the tower's and projector's tensors from a whole multimodal checkpoint
        (either saved layout; the text decoder's names are skipped, so one pass over the
        file can feed both models). ValueError on a bad shape, an unknown vision name, or
        a parameter the checkpoint did not provide."""
        # (SigLIP's pooling head is read by no one: Gemma 3 takes the last hidden states.)
        load_targets(self._targets(), weights, "Gemma 3 vision tower / projector",
                     ("vision_tower.head.",))
