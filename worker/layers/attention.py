"""Paged attention layer: store this step's K/V into the cache, then attend over it.

Keys are only ever read back from the paged cache, so prefill, chunked
prefill and decode share one code path. The per-step metadata is built once
by the model runner and passed down explicitly (no global forward context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.kernels import AttentionBackend, VarlenMetadata
from pagedserve.kernels.prefix_spans import varlen_attention_spans


@dataclass
class AttentionMetadata:
    """Everything the attention kernels need for one step, shared by all layers.

    ``is_decode`` is true when every sequence has exactly one new token; then
    ``seq_lens`` (int32 ``[S]``, cached + new) feeds ``decode_attention`` and
    ``varlen`` may be None. ``groups`` (a hybrid model's KV cache groups 1 and on,
    ``scheduler.kv_groups``) are the same step through each group's own block table
    and slots; this one is group 0's. ``image_spans`` (per sequence, absolute token
    ranges) are images whose tokens attend to each other both ways (Gemma 3); a step
    with any goes through ``kernels.prefix_spans``, the causal kernels cannot mask so.
    ``mamba`` is the step's view of a hybrid model's recurrent states
    (``worker.mamba_state.MambaStep``; None without Mamba layers).
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    is_decode: bool
    varlen: VarlenMetadata | None = None
    groups: list[AttentionMetadata] | None = None
    image_spans: list[list[tuple[int, int]]] | None = None
    mamba: Any = None


# vLLM's calculate_kv_scales: the first step's largest |k| (|v|) is stored as 200 (100),
# leaving 2.2x (4.5x) headroom below E4M3's 448 for later tokens.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


class PagedAttention:
    """Scaled dot-product attention of ``q`` over this layer's paged K/V cache.

    With KV scales (fp8 caches, ``use_kv_scales``) the cache holds ``k / k_scale`` and
    ``v / v_scale``: ``k_scale`` is folded into ``q`` and ``v_scale`` into the output,
    so the kernels never see a scale. The scales are device tensors, so captured CUDA
    graphs read the calibrated values; ``arm_calibration`` sets them from the next
    step's K/V (the engine's calibration step), once, before anything else is stored.
    ``window`` (a sliding window, the layer's own) limits each query to its own key and
    the ``window - 1`` before it; ``scale`` replaces ``head_dim ** -0.5`` (Gemma's);
    ``softcap`` caps each score to ``softcap * tanh(s / softcap)`` (Gemma 2); ``sinks``
    (``[num_heads]``, this rank's heads; GPT-OSS) join each row's softmax as learnt
    zero-valued logits, read by the kernels at every call (loading fills them in place).
    ``kv_group`` is the layer's KV cache group in a hybrid model (the worker sets it):
    the layer stores and reads through that group's table.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None):
        backend.check_window(window, softcap)
        backend.check_sinks(sinks, num_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        # Only a softcapped layer passes the argument: every backend takes the others'.
        self._extra: dict = {"window": window}
        if softcap is not None:
            self._extra["softcap"] = softcap
        if sinks is not None:
            self._extra["sinks"] = sinks
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.backend = backend
        self.kv_group = 0
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.calibrating = False

    def use_kv_scales(self, device: torch.device) -> None:
        """Store K/V divided by per-layer scales (1.0 until calibrated)."""
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)
        self.calibrating = False

    def arm_calibration(self) -> None:
        """Set the scales from the next step's K/V (``use_kv_scales`` first)."""
        if self.k_scale is None:
            raise RuntimeError("use_kv_scales must be called before arm_calibration")
        self.calibrating = True

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.k_scale is not None and self.v_scale is not None
        self.k_scale.copy_((k.abs().amax().float() / K_SCALE_CONSTANT).clamp_min(1e-8))
        self.v_scale.copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(1e-8))
        self.calibrating = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                 ) -> torch.Tensor:
        """``q[T,Hq,D]``, ``k/v[T,Hkv,D]`` -> ``[T, Hq*D]``."""
        key_cache, value_cache = kv_cache
        if self.kv_group:
            assert md.groups is not None, "a hybrid model's step without its group tables"
            md = md.groups[self.kv_group - 1]
        if self.k_scale is not None:
            if self.calibrating:
                self._calibrate(k, v)
            q, k, v = q * self.k_scale, k / self.k_scale, v / self.v_scale
        self.backend.store_kv(k, v, key_cache, value_cache, md.slot_mapping)
        if md.is_decode:
            out = self.backend.decode_attention(
                q, key_cache, value_cache, md.block_table, md.seq_lens, self.scale,
                **self._extra,
            )
        elif md.image_spans is not None:
            assert md.varlen is not None, "prefill step without varlen metadata"
            causal = None
            if not all(md.image_spans):  # the step's other sequences keep the fast kernel
                causal = self.backend.varlen_attention(
                    q, key_cache, value_cache, md.block_table, md.varlen, self.scale,
                    **self._extra)
            out = varlen_attention_spans(q, key_cache, value_cache, md.block_table, md.varlen,
                                         self.scale, md.image_spans, **self._extra, out=causal)
        else:
            assert md.varlen is not None, "prefill step without varlen metadata"
            out = self.backend.varlen_attention(
                q, key_cache, value_cache, md.block_table, md.varlen, self.scale,
                **self._extra,
            )
        if self.v_scale is not None:
            out = out * self.v_scale
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
