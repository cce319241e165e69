"""KV cache element types narrower than the model's: names, storage and conversion.

vLLM's ``kv_cache_dtype``: "auto" stores K/V in the model dtype; "float16",
"bfloat16" halve an fp32 model's pool; "fp8" (= "fp8_e4m3", OCP E4M3FN, max
448) and "fp8_e5m2" (max 57344) quarter it, so the same bytes hold 2x / 4x the
tokens. Scales are per tensor and 1.0 (vLLM's default for checkpoints without
calibrated scales): keys and values of Llama-family models sit well inside
E4M3's range, and a value beyond it saturates to +-max rather than becoming
NaN or inf (torch's own cast does not clamp on every device; fp16 alike).

Every backend computes in fp32 (or the query dtype) after widening the cached
element exactly, so a narrow cache changes only what is stored, never the
attention math: tests compare each backend against the dense oracle on the
dequantised K/V at fp32 tolerance.

fp8 tensors lack ``index_copy_`` / ``index_select`` kernels on some devices,
so every data movement of a cache goes through :func:`storage_view` (a uint8
view of the same bytes); moving bytes is exact whatever they encode.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = ("auto", *_NAMES)


def check_kv_cache_dtype(name: str) -> None:
    """Raise ``ValueError`` naming the field unless ``name`` is a known KV cache dtype."""
    if not isinstance(name, str) or name.lower() not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, "
                         f"got {name!r}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV pool: the model's for "auto", else the named one."""
    check_kv_cache_dtype(name)
    key = name.lower()
    return model_dtype if key == "auto" else _NAMES[key]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """Short name for stats and logs: "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"."""
    if dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as uint8 for fp8 (same shape), the cache itself otherwise."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache dtype; fp8 and fp16 saturate at their largest finite value."""
    if x.dtype == dtype:
        return x
    if dtype in FP8_DTYPES or (dtype == torch.float16 and x.dtype != torch.float16):
        m = torch.finfo(dtype).max
        return x.float().clamp(-m, m).to(dtype)
    return x.to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached elements widened to ``dtype`` (exact for every narrower cache dtype)."""
    if x.dtype == dtype:
        return x
    if x.dtype in FP8_DTYPES and dtype not in (torch.float32, torch.float64):
        return x.float().to(dtype)
    return x.to(dtype)
