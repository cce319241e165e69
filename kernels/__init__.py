"""pagedserve.kernels: paged attention ops on the KV layout ``[blocks, B, Hkv, D]``.

Importing this package needs only torch; triton and flash_attn are imported
when their backend is requested.
"""

from pagedserve.kernels.backend import AttentionBackend, available_backends, get_backend
from pagedserve.kernels.metadata import VarlenMetadata, build_varlen_metadata
from pagedserve.kernels.reference import dense_causal_attention

__all__ = [
    "AttentionBackend",
    "VarlenMetadata",
    "available_backends",
    "build_varlen_metadata",
    "dense_causal_attention",
    "get_backend",
]
