"""Attention backend interface and selection.

The model runner talks to one :class:`AttentionBackend` object, so the same
model code runs on the CPU reference path, on Triton kernels, or on
flash-attn. Backends are looked up lazily by name: importing this module never
imports triton or flash_attn, so ``import pagedserve.kernels`` works on a bare
CPU install.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from abc import ABC, abstractmethod

import torch

from pagedserve.kernels.kv_quant import storage_view
from pagedserve.kernels.metadata import VarlenMetadata

BACKEND_NAMES = ("torch", "cpu", "triton", "flash")


class AttentionBackend(ABC):
    """Paged attention ops on the KV layout ``[num_blocks, block_size, Hkv, D]``.

    Block copy and swap are plain tensor copies, identical for every backend,
    so they live here; backends override them only with a faster kernel.
    """

    name: str = "abstract"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def take_counters(self) -> dict[str, int]:
        """Counters since the last call (how often a backend's shortcut engaged, once
        per step, not per layer), which the engine adds to its stats; most have none."""
        return {}

    def supports_block_size(self, block_size: int) -> bool:
        """Whether this backend accepts caches with ``block_size`` tokens per block."""
        return block_size >= 1

    def supports_kv_cache_dtype(self, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        """Whether this backend reads caches of ``kv_dtype`` under a ``model_dtype`` model."""
        return True

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key/value[t]`` into flat slot ``slot_mapping[t]``; slot -1 is skipped."""

    @abstractmethod
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
        """Causal (bottom-right aligned) attention of packed queries over paged keys.

        With a sliding ``window`` a query sees only its own key and the ``window - 1``
        before it (Mistral's, and Hugging Face's, convention); keys further back are
        never read, so their blocks may already be gone from the table. A ``softcap``
        bounds each scaled score ``s`` to ``softcap * tanh(s / softcap)`` before the
        softmax (Gemma 2's attention logit softcapping). ``sinks`` (fp32 ``[Hq]``,
        GPT-OSS's attention sinks) is a learnt logit per query head that joins every
        row's softmax as one more score with a zero value: it takes a share of the
        weight, so a row's output is scaled by ``L / (L + exp(sink))``, ``L`` the sum
        of its keys' ``exp(score)`` (backends without them refuse, ``supports_sinks``).
        """

    @abstractmethod
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
        """One query per sequence attending to keys ``[0, cache_seqlens[s])``, or with a
        sliding ``window`` to keys ``[cache_seqlens[s] - window, cache_seqlens[s])``;
        ``softcap`` and ``sinks`` as in :meth:`varlen_attention`."""

    def supports_sinks(self) -> bool:
        """Whether ``sinks`` (GPT-OSS's attention sinks) are taken; most backends do."""
        return True

    def check_sinks(self, sinks: torch.Tensor | None, num_heads: int) -> None:
        """``ValueError`` for sinks this backend refuses or that are not ``[num_heads]``
        floats (None: none)."""
        if sinks is None:
            return
        if not self.supports_sinks():
            raise ValueError(f"attention backend {self.name!r} has no attention sinks "
                             "(GPT-OSS's); use 'triton' on CUDA")
        if sinks.dim() != 1 or sinks.shape[0] != num_heads or not sinks.is_floating_point():
            raise ValueError(f"sinks must be a float tensor of shape [{num_heads}] (one per "
                             f"query head), got {tuple(sinks.shape)} {sinks.dtype}")

    @staticmethod
    def check_window(window: int | None, softcap: float | None = None) -> None:
        """``ValueError`` for a window that is not a positive int (None: no window) or a
        softcap that is not a positive number (None: none)."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"sliding window must be a positive int or None, got {window!r}")
        if softcap is not None and (isinstance(softcap, bool)
                                    or not isinstance(softcap, (int, float))
                                    or not softcap > 0):
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")

    def copy_blocks(
        self,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        pairs: torch.Tensor,
    ) -> None:
        """Copy-on-write: block ``src`` -> ``dst`` in every layer's K and V cache."""
        if pairs.numel() == 0:
            return
        for kc, vc in zip(key_caches, value_caches, strict=True):
            kc, vc = storage_view(kc), storage_view(vc)
            p = pairs.to(kc.device, torch.long)
            src, dst = p[:, 0], p[:, 1]
            # index_select makes a copy first, so a dst that is also a src reads old data.
            kc.index_copy_(0, dst, kc.index_select(0, src))
            vc.index_copy_(0, dst, vc.index_select(0, src))

    def swap_blocks(
        self,
        src_caches: list[torch.Tensor],
        dst_caches: list[torch.Tensor],
        pairs: torch.Tensor,
    ) -> None:
        """Move blocks between tiers (device pool <-> CPU pool), per layer.

        ``pairs[:, 0]`` are block ids of ``src_caches``, ``pairs[:, 1]`` of
        ``dst_caches``; the tiers may differ in device and block count.
        """
        if pairs.numel() == 0:
            return
        pairs_cpu = pairs.to("cpu", torch.long)
        for src, dst in zip(src_caches, dst_caches, strict=True):
            if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
                raise ValueError(f"block shapes differ: {tuple(src.shape)} {src.dtype} vs "
                                 f"{tuple(dst.shape)} {dst.dtype}")
            src, dst = storage_view(src), storage_view(dst)
            s_idx = pairs_cpu[:, 0].to(src.device)
            d_idx = pairs_cpu[:, 1].to(dst.device)
            # Host-to-device may be asynchronous (stream order covers it); device-to-host
            # must not be: index_copy_ on the CPU reads the blocks at once.
            blocks = src.index_select(0, s_idx).to(dst.device,
                                                   non_blocking=dst.device.type != "cpu")
            dst.index_copy_(0, d_idx, blocks)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={self.device})"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_imported_without_interpreter() -> bool:
    """True when triton.language was imported before TRITON_INTERPRET was set.

    ``@triton.jit`` picks compiled vs interpreted at decoration time, and
    triton.language's own helpers (``tl.cdiv``...) were decorated at import;
    interpreted kernels calling compiled helpers fail. ``torch._dynamo``
    imports triton, so this happens when a test session sets the variable late.
    """
    std = sys.modules.get("triton.language.standard")
    return std is not None and type(std.cdiv).__name__ == "JITFunction"


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device``, or None when it can."""
    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"the native CPU kernels run on 'cpu', got {device.type!r}"
        from pagedserve.kernels import cpu_native

        if cpu_native.load() is None:
            return ("no C compiler, the kernel build failed, or PAGEDSERVE_NATIVE_KERNELS=0 "
                    "(see the log)")
        return None
    if name == "triton":
        if not _has_module("triton"):
            return "the 'triton' package is not installed (pip install 'pagedserve[triton]')"
        if device.type == "cpu":
            if not _triton_interpreter_on():
                return (
                    "Triton kernels need a CUDA device, got 'cpu' (set TRITON_INTERPRET=1 "
                    "before importing triton to run them in the interpreter)"
                )
            if _triton_imported_without_interpreter():
                return "triton was imported before TRITON_INTERPRET=1 was set"
            return None
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"Triton kernels need a CUDA device, got {device.type!r}"
        return None
    if name == "flash":
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"flash-attn needs a CUDA device, got {device.type!r}"
        if not _has_module("flash_attn"):
            return "the 'flash_attn' package is not installed (pip install 'pagedserve[gpu]')"
        return None
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on ``device``, best first.

    On CPU, triton is listed only under ``TRITON_INTERPRET=1`` (tests).
    """
    dev = torch.device(device)
    return [n for n in ("flash", "triton", "cpu", "torch") if _unavailable_reason(n, dev) is None]


def get_backend(
    name: str | None = None, device: torch.device | str = "cpu",
    kv_cache_dtype: torch.dtype | None = None, model_dtype: torch.dtype | None = None,
    needs_sinks: bool = False,
) -> AttentionBackend:
    """Return a backend instance; ``None`` picks flash, then triton on CUDA, and on
    CPU the native kernels ("cpu") when they build, else torch.

    With ``kv_cache_dtype`` and ``model_dtype`` given, the automatic choice skips
    backends that cannot read such a cache (flash-attn reads only the model's
    fp16/bf16), and an explicit choice that cannot raises ``ValueError``; so too
    for ``needs_sinks`` (a model with attention sinks, GPT-OSS: not flash-attn's).
    An explicit choice that cannot run raises ``RuntimeError`` with the reason,
    rather than silently falling back to a slower path.
    """
    dev = torch.device(device)
    if name is not None:
        name = name.lower()
        if name not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
        reason = _unavailable_reason(name, dev)
        if reason is not None:
            raise RuntimeError(f"attention backend {name!r} is unavailable: {reason}")
        backend = _instantiate(name, dev)
        if needs_sinks and not backend.supports_sinks():
            raise ValueError(f"attention backend {name!r} has no attention sinks, which this "
                             "model (GPT-OSS) needs; choose another backend")
        if not _reads(backend, kv_cache_dtype, model_dtype):
            raise ValueError(
                f"attention backend {name!r} cannot read a {kv_cache_dtype} KV cache under a "
                f"{model_dtype} model (kv_cache_dtype); choose another backend or kv_cache_dtype"
            )
        return backend
    if dev.type == "cuda":
        candidates = available_backends(dev)
    else:
        candidates = ["cpu" if _unavailable_reason("cpu", dev) is None else "torch"]
    for cand in candidates:
        backend = _instantiate(cand, dev)
        if _reads(backend, kv_cache_dtype, model_dtype) and (
                backend.supports_sinks() or not needs_sinks):
            return backend
    raise ValueError(f"no attention backend on {dev} reads a {kv_cache_dtype} KV cache "
                     f"under a {model_dtype} model (kv_cache_dtype)")


def backend_with_sinks(backend: AttentionBackend, name: str | None,
                       kv_cache_dtype: torch.dtype | None = None,
                       model_dtype: torch.dtype | None = None) -> AttentionBackend:
    """``backend`` if it takes attention sinks, else (chosen automatically, ``name`` None)
    the next automatic choice that does: a GPT-OSS model on a box with flash-attn runs
    Triton. An explicit ``name`` that has none is a ``ValueError``."""
    if backend.supports_sinks():
        return backend
    return get_backend(name, backend.device, kv_cache_dtype, model_dtype, needs_sinks=True)


def _reads(backend: AttentionBackend, kv_dtype: torch.dtype | None,
           model_dtype: torch.dtype | None) -> bool:
    if kv_dtype is None or model_dtype is None:
        return True
    return backend.supports_kv_cache_dtype(kv_dtype, model_dtype)


def _instantiate(name: str, dev: torch.device) -> AttentionBackend:
    if name == "torch":
        from pagedserve.kernels.torch_ref import TorchBackend

        return TorchBackend(dev)
    if name == "cpu":
        from pagedserve.kernels.cpu_backend import CpuNativeBackend

        return CpuNativeBackend(dev)
    if name == "triton":
        mod = importlib.import_module("pagedserve.kernels.triton_backend")
        return mod.TritonBackend(dev)
    mod = importlib.import_module("pagedserve.kernels.flash")
    return mod.FlashBackend(dev)
