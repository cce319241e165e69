"""Process-wide test environment, set before any test module imports triton or Ray.

- ``TRITON_INTERPRET=1`` without CUDA: triton reads it at import time, and
  ``torch._dynamo`` (pulled in by transformers) may import triton first.
- ``RAY_AUTH_MODE=disabled``: a fresh local ``ray.init`` would otherwise turn
  token auth on and clients given an explicit address would fail.
- ``HF_HUB_OFFLINE=1``: nothing is ever downloaded.
"""

import os
import sys
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for ``--dist loadgroup`` (pyproject's addopts), made before xdist reads them.

    Every ``ray``-marked test is in one group, so one worker runs them in collection
    order and two Ray clusters never start side by side (a bare ``ray.init()`` could
    join the other, and the chaos tests' timings assume one). Every other module is a
    group of its own, so a module's fixtures are built once, on one worker.
    """
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _ray_only_in_ray_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves Ray running must be marked ``ray``: unmarked, it could run on
    the other worker beside the Ray group's cluster."""
    yield
    ray = sys.modules.get("ray")
    if (ray is not None and request.node.get_closest_marker("ray") is None
            and ray.is_initialized()):
        pytest.fail(f"Ray is running after {request.node.nodeid}, which is not marked "
                    "'ray': it, or a test before it on this worker, left Ray started")
