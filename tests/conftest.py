"""Process-wide test environment, set before any test module imports triton or Ray.

- ``TRITON_INTERPRET=1`` without CUDA: triton reads it at import time, and
  ``torch._dynamo`` (pulled in by transformers) may import triton first.
- ``RAY_AUTH_MODE=disabled``: a fresh local ``ray.init`` would otherwise turn
  token auth on and clients given an explicit address would fail.
- ``HF_HUB_OFFLINE=1``: nothing is ever downloaded.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
