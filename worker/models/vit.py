"""The pre-LayerNorm transformer layer SigLIP and CLIP towers share, and their helpers.

Both image encoders (``gemma3_vision``: SigLIP; ``llava_vision``: CLIP) stack the same
layer: LayerNorm, bidirectional multi-head attention with biases, LayerNorm, a two-layer
MLP; they differ in the activation (GELU-tanh, quick GELU) and around the stack.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.layers.linear import LazyTensor

# [model.]vision_tower.[vision_model.]X and [model.]multi_modal_projector.X: the saved
# layouts of released files, transformers 4.5x saves and 5.x saves (no vision_model.).
_NAME_RE = re.compile(r"^(?:model\.)?(?:(vision_tower)\.(?:vision_model\.)?|"
                      r"(multi_modal_projector)\.)")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
}


@dataclass(frozen=True)
class TowerConfig:
    """A vision tower's shape (SigLIP's or CLIP's), validated; errors name the HF config
    field at fault. The encoders add their projector's fields."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.num_attention_heads ({self.num_heads}) does not "
                             f"divide vision_config.hidden_size ({self.hidden_size})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config.patch_size ({self.patch_size}) does not divide "
                             f"vision_config.image_size ({self.image_size})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of "
                             f"{sorted(ACTIVATIONS)}")


def positive_int(cfg: dict, key: str, where: str) -> int:
    """``cfg[key]`` as a positive int; ``ValueError`` names ``where.key``."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where + '.' if where else ''}{key} is {value!r}, not a positive int")
    return value


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised frozen weight (the checkpoint fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class EncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + fc2(act(fc1(ln2(x))))``; q/k/v fused in one weight.
    ``cfg`` has ``hidden_size``, ``intermediate_size``, ``num_heads``, ``layer_norm_eps``
    and ``hidden_act`` (a key of ``ACTIVATIONS``)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        p = functools.partial(param, dtype=dtype, device=device)
        self.cfg, self.act = cfg, ACTIVATIONS[cfg.hidden_act]
        self.ln1_weight, self.ln1_bias, self.ln2_weight, self.ln2_bias = p(h), p(h), p(h), p(h)
        self.qkv_weight, self.qkv_bias = p(3 * h, h), p(3 * h)
        self.out_weight, self.out_bias = p(h, h), p(h)
        self.fc1_weight, self.fc1_bias = p(i, h), p(i)
        self.fc2_weight, self.fc2_bias = p(h, i), p(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, h = x.shape
        eps, heads = self.cfg.layer_norm_eps, self.cfg.num_heads
        y = F.layer_norm(x, (h,), self.ln1_weight, self.ln1_bias, eps)
        qkv = F.linear(y, self.qkv_weight, self.qkv_bias).view(n, length, 3, heads, h // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)  # no mask; scale head_dim ** -0.5
        x = x + F.linear(y.transpose(1, 2).reshape(n, length, h), self.out_weight, self.out_bias)
        y = F.layer_norm(x, (h,), self.ln2_weight, self.ln2_bias, eps)
        y = self.act(F.linear(y, self.fc1_weight, self.fc1_bias))
        return x + F.linear(y, self.fc2_weight, self.fc2_bias)

    def targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the tensor (or fused-q/k/v slice) it is copied into."""
        h, out = self.cfg.hidden_size, {}
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{prefix}self_attn.{proj}.weight"] = self.qkv_weight[j * h:(j + 1) * h]
            out[f"{prefix}self_attn.{proj}.bias"] = self.qkv_bias[j * h:(j + 1) * h]
        for ours, theirs in (("ln1", "layer_norm1"), ("ln2", "layer_norm2"),
                             ("out", "self_attn.out_proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            out[f"{prefix}{theirs}.weight"] = getattr(self, f"{ours}_weight")
            out[f"{prefix}{theirs}.bias"] = getattr(self, f"{ours}_bias")
        return out


@torch.no_grad()
def tower_key(name: str) -> str | None:
    """A SigLIP / CLIP tower's or projector's checkpoint name in any saved layout as
    ``vision_tower.X`` / ``multi_modal_projector.X``; None for another model's."""
    m = _NAME_RE.match(name)
    return None if m is None else f"{m.group(1) or m.group(2)}.{name[m.end():]}"


def load_targets(targets: dict[str, torch.Tensor], weights: Iterable[tuple[str, LazyTensor]],
                 what: str, ignored: tuple[str, ...] = (),
                 key_of: Callable[[str], str | None] = tower_key) -> None:
    """Copy a multimodal checkpoint's tower and projector tensors into ``targets``
    (keyed ``vision_tower.X`` / ``multi_modal_projector.X``; any saved layout; the text
    decoder's names skipped, so one pass over the file feeds both models; keys starting
    with ``ignored`` read by no one). ``ValueError`` on a bad shape, a name not in
    ``targets`` (a ``what`` tensor), or a target the checkpoint did not provide.
    ``key_of`` names a checkpoint tensor as ``targets`` does (None: not the tower's)."""
    seen = set()
    for name, lazy in weights:
        key = key_of(name)
        if key is None or key.startswith(ignored):
            continue
        dst = targets.get(key)
        if dst is None:
            raise ValueError(f"{name}: not a {what} tensor")
        if tuple(lazy.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(lazy[:])
        seen.add(key)
    missing = sorted(targets.keys() - seen)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} vision tensor(s): {missing[:5]}")
