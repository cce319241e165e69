"""Qwen2-VL's and Qwen2.5-VL's image encoder: a native-resolution ViT and its patch merger.

``encoder(pixel_values)`` is Hugging Face's ``visual(flatten_patches, grid_thw)`` for one
resized, normalised image: the image is cut into ``patch_size`` patches in the image
processor's merge-block order (each ``spatial_merge_size``-square block of patches
contiguous, the still image repeated ``temporal_patch_size`` times), embedded by the
bias-free Conv3d (one matmul here), then run through pre-norm blocks with 2-D rotary
attention (row and column indices each rotate a quarter of every head's dimensions), and
every block's ``merge^2`` tokens are concatenated into one LLM token by the merger.

Qwen2-VL: LayerNorm, full attention over the image, ``fc2(act(fc1(x)))``. Qwen2.5-VL:
RMSNorm, a gated MLP, and attention within ``window_size``-pixel windows except in the
``fullatt_block_indexes`` layers; the tokens are permuted into window order before the
blocks and the merger's rows are permuted back after it, as HF does. Every norm's eps is
HF's hard-coded 1e-6. Plain torch: no transformers at run time (its config classes only
supply defaults when the config is read).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.models.qwen2_vision_config import (
    ACTIVATIONS_QWEN,
    Qwen2VisionConfig,
    image_grid,
    patches_to_images,
    patchify,
    patchify_frames,
)
from pagedserve.worker.models.vit import load_targets, param

__all__ = ["Qwen2VisionConfig", "Qwen2VisionEncoder", "image_grid", "patches_to_images"]

# visual.X: released files and save_pretrained's output; model.visual.X: transformers 5 in memory.
_NAME_RE = re.compile(r"^(?:model\.)?visual\.")
_IGNORED = ("visual.rotary_pos_emb.",)  # the inverse frequencies, recomputed here


def _visual_key(name: str) -> str | None:
    """``visual.X`` for the tower's tensors in either layout; None for the decoder's."""
    match = _NAME_RE.match(name)
    return None if match is None else "visual." + name[match.end():]
_EPS = 1e-6


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb_vision`` for one of q/k ``[n, heads, d]``: in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class _Windows:
    """Contiguous runs of the token sequence attended to separately, padded to one length so
    that a single batched attention call covers them all."""

    def __init__(self, lengths: torch.Tensor):
        offsets = torch.arange(int(lengths.max()), device=lengths.device)
        self.valid = offsets < lengths[:, None]
        self.index = torch.where(self.valid, (lengths.cumsum(0) - lengths)[:, None] + offsets, 0)
        self.ragged = not bool(self.valid.all())


class _Block(nn.Module):
    """``x + proj(attn(norm1(x)))``, then ``x + mlp(norm2(x))``; Qwen2.5-VL's gate and up
    projections fused into one matmul."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        p = functools.partial(param, dtype=dtype, device=device)
        self.cfg, self.act = cfg, ACTIVATIONS_QWEN[cfg.hidden_act]
        self.norm1_weight, self.norm2_weight = p(h), p(h)
        self.norm1_bias, self.norm2_bias = (None, None) if cfg.windowed else (p(h), p(h))
        self.qkv_weight, self.qkv_bias = p(3 * h, h), p(3 * h)
        self.proj_weight, self.proj_bias = p(h, h), p(h)
        up = 2 * i if cfg.windowed else i
        self.up_weight, self.up_bias = p(up, h), p(up)
        self.down_weight, self.down_bias = p(h, i), p(h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: _Windows | None) -> torch.Tensor:
        n, heads = x.shape[0], self.cfg.num_heads
        y = _norm(x, self.norm1_weight, self.norm1_bias)
        q, k, v = F.linear(y, self.qkv_weight, self.qkv_bias).view(n, 3, heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if windows is None:
            y = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)))
            y = y.transpose(0, 1).reshape(n, -1)
        else:
            q, k, v = (t[windows.index].transpose(1, 2) for t in (q, k, v))
            mask = windows.valid[:, None, None, :] if windows.ragged else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            y = y.transpose(1, 2)[windows.valid].reshape(n, -1)
        x = x + F.linear(y, self.proj_weight, self.proj_bias)
        y = F.linear(_norm(x, self.norm2_weight, self.norm2_bias), self.up_weight, self.up_bias)
        if self.cfg.windowed:
            gate, up = y.chunk(2, dim=-1)
            y = self.act(gate) * up
        else:
            y = self.act(y)
        return x + F.linear(y, self.down_weight, self.down_bias)

    def targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the tensor (or fused gate/up slice) it is copied into."""
        out, i = {}, self.cfg.intermediate_size
        for kind in ("weight", "bias"):
            out[f"{prefix}attn.qkv.{kind}"] = getattr(self, f"qkv_{kind}")
            out[f"{prefix}attn.proj.{kind}"] = getattr(self, f"proj_{kind}")
            for j in (1, 2):
                if getattr(self, f"norm{j}_{kind}") is not None:
                    out[f"{prefix}norm{j}.{kind}"] = getattr(self, f"norm{j}_{kind}")
            up, down = getattr(self, f"up_{kind}"), getattr(self, f"down_{kind}")
            if self.cfg.windowed:
                out[f"{prefix}mlp.gate_proj.{kind}"] = up[:i]
                out[f"{prefix}mlp.up_proj.{kind}"] = up[i:]
                out[f"{prefix}mlp.down_proj.{kind}"] = down
            else:
                out[f"{prefix}mlp.fc1.{kind}"], out[f"{prefix}mlp.fc2.{kind}"] = up, down
        return out


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """LayerNorm when there is a bias (Qwen2-VL); else HF's RMSNorm (Qwen2.5-VL: in fp32,
    cast back before the weight multiplies)."""
    if bias is not None:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, _EPS)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _EPS)).to(x.dtype)


class Qwen2VisionEncoder(nn.Module):
    """One image ``[1, C, H, W]`` -> its LLM tokens ``[1, H/P/m * W/P/m, text_hidden]``;
    a video's frames through ``encode_video``."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, m2 = cfg.hidden_size, cfg.merge_size ** 2
        p = functools.partial(param, dtype=dtype, device=device)
        self.cfg = cfg
        self.patch_weight = p(h, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size,
                              cfg.patch_size)
        self.blocks = nn.ModuleList(_Block(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.ln_q_weight = p(h)
        self.ln_q_bias = None if cfg.windowed else p(h)
        self.mlp0_weight, self.mlp0_bias = p(h * m2, h * m2), p(h * m2)
        self.mlp2_weight, self.mlp2_bias = p(cfg.out_hidden_size, h * m2), p(cfg.out_hidden_size)

    @classmethod
    def from_hf_config(cls, hf_config: dict, dtype: torch.dtype,
                       device: torch.device) -> Qwen2VisionEncoder:
        """Build from the config.json dict (``model_type`` ``qwen2_vl`` or ``qwen2_5_vl``),
        so the serving config needs no transformers objects; ValueError names a bad field."""
        return cls(Qwen2VisionConfig.from_hf(hf_config), dtype, device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[1, C, H, W]`` (resized and normalised, as the processor leaves it before
        patchifying) -> ``[1, (H/P/m) * (W/P/m), out_hidden]`` in the encoder's dtype, the
        pixels cast to it first as HF does. ValueError unless H and W are positive multiples
        of ``patch_size * spatial_merge_size``."""
        cfg, w = self.cfg, self.patch_weight
        m, unit = cfg.merge_size, cfg.patch_size * cfg.merge_size
        shape = tuple(pixel_values.shape)
        if (len(shape) != 4 or shape[:2] != (1, cfg.num_channels) or min(shape[2:]) <= 0
                or shape[2] % unit or shape[3] % unit):
            raise ValueError(f"pixel_values shape {shape} is not [1, {cfg.num_channels}, H, W] "
                             f"with H and W positive multiples of {unit} (patch_size "
                             f"{cfg.patch_size} * spatial_merge_size {m})")
        x = patchify(pixel_values[0].to(device=w.device, dtype=w.dtype), cfg.patch_size,
                     cfg.temporal_patch_size, m)
        return self._encode(x, shape[2] // cfg.patch_size, shape[3] // cfg.patch_size)[None]

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """``[T, C, H, W]`` frames (resized and normalised; ``T`` a multiple of
        ``temporal_patch_size``) -> ``[T / tp * (H/P/m) * (W/P/m), out_hidden]``: HF's
        ``visual(pixel_values_videos, video_grid_thw)``. Each temporal slice (``tp``
        consecutive frames, one Conv3d patch deep) is its own sequence in every block, as
        HF's per-frame ``cu_seqlens`` and window index make it; the slices share every
        matmul. ValueError on a bad shape."""
        cfg, w = self.cfg, self.patch_weight
        tp, unit = cfg.temporal_patch_size, cfg.patch_size * cfg.merge_size
        shape = tuple(frames.shape)
        if (len(shape) != 4 or shape[1] != cfg.num_channels or not shape[0] or shape[0] % tp
                or min(shape[2:]) <= 0 or shape[2] % unit or shape[3] % unit):
            raise ValueError(f"video frames shape {shape} is not [T, {cfg.num_channels}, H, W] "
                             f"with T a positive multiple of temporal_patch_size {tp} and H, W "
                             f"positive multiples of {unit}")
        rows, cols = shape[2] // cfg.patch_size, shape[3] // cfg.patch_size
        frames = frames.to(device=w.device, dtype=w.dtype)
        x = torch.cat([patchify_frames(frames[k:k + tp], cfg.patch_size, cfg.merge_size)
                       for k in range(0, shape[0], tp)])
        return self._encode(x, rows, cols, shape[0] // tp)

    def _encode(self, patches: torch.Tensor, rows: int, cols: int,
                slices: int = 1) -> torch.Tensor:
        """``slices`` temporal slices' flattened patches ``[slices * rows * cols,
        C*tp*P*P]`` (merge-block order, slice after slice) -> their LLM tokens
        ``[slices * rows/m * cols/m, out_hidden]``. The slices run as one batch through
        every matmul; attention stays within a slice (within a window of it, Qwen2.5-VL),
        as HF's per-frame ``cu_seqlens`` keep it."""
        cfg, w = self.cfg, self.patch_weight
        m = cfg.merge_size
        x = F.linear(patches, w.view(w.shape[0], -1))
        pos = self._positions(rows, cols, w.device).repeat(slices, 1)
        n = rows * cols
        whole = _Windows(torch.full((slices,), n, device=w.device)) if slices > 1 else None
        order = windows = None
        if cfg.windowed:
            one, lengths = self._window_order(rows // m, cols // m, w.device)
            per = n // (m * m)  # merged tokens a slice
            order = torch.cat([one + k * per for k in range(slices)])
            x = x.view(-1, m * m, x.shape[-1])[order].view_as(x)
            pos = pos.view(-1, m * m, 2)[order].view_as(pos)
            windows = _Windows(lengths.repeat(slices) * m * m)
        else:
            windows = whole
        cos, sin = self._rope(pos)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in cfg.fullatt_blocks else windows)
        x = _norm(x, self.ln_q_weight, self.ln_q_bias).reshape(-1, self.mlp0_weight.shape[1])
        x = F.linear(F.gelu(F.linear(x, self.mlp0_weight, self.mlp0_bias)), self.mlp2_weight,
                     self.mlp2_bias)
        if order is not None:
            x = x[torch.argsort(order)]
        return x

    def _positions(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Each patch's (row, col) ``[rows * cols, 2]``, in the merge-block order."""
        m = self.cfg.merge_size
        h, w = torch.meshgrid(torch.arange(rows, device=device),
                              torch.arange(cols, device=device), indexing="ij")
        blocks = (rows // m, m, cols // m, m)
        return torch.stack([t.reshape(blocks).transpose(1, 2).flatten() for t in (h, w)], -1)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, 1, head_dim]`` in fp32: the row's angles over the first
        quarter of the dims, the column's over the second, the whole repeated once."""
        half = self.cfg.head_dim // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float, device=pos.device) / half))
        freqs = (pos[..., None].float() * inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def _window_order(self, rows: int, cols: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's ``get_vision_window_index`` for one image: the merged tokens' order when
        ``merger_window``-square windows are taken row by row (each window's tokens row by
        row), and every non-empty window's size in merged tokens."""
        win = self.cfg.merger_window
        pad_h, pad_w = win - rows % win, win - cols % win
        nh, nw = (rows + pad_h) // win, (cols + pad_w) // win
        index = torch.arange(rows * cols, device=device).view(rows, cols)
        index = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        index = index.view(nh, win, nw, win).permute(0, 2, 1, 3).reshape(nh * nw, win * win)
        lengths = (index >= 0).sum(1)
        return index[index >= 0], lengths[lengths > 0]

    def _targets(self) -> dict[str, torch.Tensor]:
        out = {"visual.patch_embed.proj.weight": self.patch_weight,
               "visual.merger.ln_q.weight": self.ln_q_weight,
               "visual.merger.mlp.0.weight": self.mlp0_weight,
               "visual.merger.mlp.0.bias": self.mlp0_bias,
               "visual.merger.mlp.2.weight": self.mlp2_weight,
               "visual.merger.mlp.2.bias": self.mlp2_bias}
        if self.ln_q_bias is not None:
            out["visual.merger.ln_q.bias"] = self.ln_q_bias
        for i, block in enumerate(self.blocks):
            out.update(block.targets(f"visual.blocks.{i}."))
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Copy the tower's and merger's tensors from a whole checkpoint (``visual.X`` or
        ``model.visual.X``; every other name, the text decoder's, skipped, so one pass over
        the file can feed both models). ValueError on a bad shape, an unknown vision name,
        or a parameter the checkpoint did not provide."""
        load_targets(self._targets(), weights, f"{self.cfg.model_type} vision", _IGNORED,
                     _visual_key)
