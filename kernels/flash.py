"""flash-attn backend (optional, CUDA only): the fastest path when installed.

flash-attn takes the KV layout ``[num_blocks, block_size, Hkv, D]`` and an
int32 block table natively, so this is a thin adapter. Mainline FA2 paged KV
requires ``block_size % 256 == 0``; the engine config chooses the block size
per backend. flash-attn computes only in fp16/bf16. New tokens are written
with the Triton store kernel when triton is present (no host sync), else with
the torch path.
"""

from __future__ import annotations

import importlib

import torch

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.metadata import VarlenMetadata
from pagedserve.kernels.torch_ref import store_kv_torch

FLASH_BLOCK_MULTIPLE = 256


def _import_flash_attn():
    try:
        return importlib.import_module("flash_attn")
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "attention backend 'flash' needs the flash_attn package "
            "(pip install 'pagedserve[gpu]'), which only builds for CUDA"
        ) from exc


class FlashBackend(AttentionBackend):
    """Paged attention through ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``."""

    name = "flash"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__(device)
        fa = _import_flash_attn()
        self._varlen = fa.flash_attn_varlen_func
        self._with_kvcache = fa.flash_attn_with_kvcache
        self._triton = None
        try:
            from pagedserve.kernels.triton_backend import TritonBackend

            self._triton = TritonBackend(device)
        except ImportError:
            self._triton = None

    def supports_block_size(self, block_size: int) -> bool:
        return block_size > 0 and block_size % FLASH_BLOCK_MULTIPLE == 0

    def supports_sinks(self) -> bool:
        """Mainline flash-attn (FA2) has no attention sinks (vLLM's FA3 fork's ``s_aux``)."""
        return False

    def supports_kv_cache_dtype(self, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        """FA2 reads K/V in the query's own fp16/bf16 only (no fp8 or mixed caches)."""
        return kv_dtype == model_dtype and kv_dtype in (torch.float16, torch.bfloat16)

    def _check(self, q: torch.Tensor, key_cache: torch.Tensor,
               window: int | None = None, softcap: float | None = None) -> None:
        self.check_window(window, softcap)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash-attn computes in fp16/bf16 only, got {q.dtype}")
        if not self.supports_block_size(key_cache.shape[1]):
            raise ValueError(
                f"flash-attn paged KV needs block_size % {FLASH_BLOCK_MULTIPLE} == 0, "
                f"got {key_cache.shape[1]}"
            )

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self._triton is not None:
            self._triton.store_kv(key, value, key_cache, value_cache, slot_mapping)
        else:
            store_kv_torch(key, value, key_cache, value_cache, slot_mapping)

    def varlen_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        md: VarlenMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check(q, key_cache, window, softcap)
        self.check_sinks(sinks, q.shape[1])
        dev = q.device
        return self._varlen(
            q,
            key_cache,
            value_cache,
            md.cu_seq_lens_q.to(dev, torch.int32),
            md.cu_seq_lens_k.to(dev, torch.int32),
            md.max_length_q,
            md.max_length_k,
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
            softcap=softcap or 0.0,
            block_table=block_table.to(dev, torch.int32),
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check(q, key_cache, window, softcap)
        self.check_sinks(sinks, q.shape[1])
        dev = q.device
        out = self._with_kvcache(
            q.unsqueeze(1),
            key_cache,
            value_cache,
            cache_seqlens=cache_seqlens.to(dev, torch.int32),
            block_table=block_table.to(dev, torch.int32),
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
            softcap=softcap or 0.0,
        )
        # The contract says a sequence with no keys yields zeros; make it explicit.
        empty = (cache_seqlens.to(dev) == 0)[:, None, None]
        return out.squeeze(1).masked_fill(empty, 0.0)


def _window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size`` (keys left and right of the query's own, -1 for no
    limit) for our window, which counts the query's own key: ``(window - 1, 0)``."""
    return (-1, -1) if window is None else (window - 1, 0)
