"""Process-wide test environment, set before any test module imports triton or Ray.

- ``TRITON_INTERPRET=1`` without CUDA: triton reads it at import time, and
  ``torch._dynamo`` (pulled in by transformers) may import triton first.
- ``RAY_AUTH_MODE=disabled``: a fresh local ``ray.init`` would otherwise turn
  token auth on and clients given an explicit address would fail.
- ``HF_HUB_OFFLINE=1``: nothing is ever downloaded.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# Fixtures that start a Ray cluster: a test using one is a Ray test, marked or not.
RAY_FIXTURES = frozenset({"cluster", "nodes", "ray_cluster", "ray_local"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``ray`` every test that uses a fixture of ``RAY_FIXTURES`` (before ``-m``
    selects), so ``-m "not ray"`` leaves out every test that starts Ray."""
    for item in items:
        if RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
