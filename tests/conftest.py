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


# Fixtures that start a Ray cluster: a test using one is a Ray test, marked or not.
RAY_FIXTURES = frozenset({"cluster", "nodes", "ray_cluster", "ray_local"})
_ran_a_ray_test = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Ray tests first, and the groups ``--dist loadgroup`` deals (pyproject's addopts).

    Every Ray test (``ray``-marked, or using a fixture of ``RAY_FIXTURES``, which marks
    it) is in one group, so one worker runs them in collection order and two Ray
    clusters never run side by side (the chaos tests' timings assume one cluster on
    the cores). They come first (a stable sort), so that group is the first unit dealt
    and its worker starts on it at once: it is the suite's critical path. Every other
    module is a group of its own, so a module's fixtures are built once, on one worker.
    """
    for item in items:
        if RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: item.get_closest_marker("ray") is None)
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, a worker whose first test is not a Ray test lowers its priority to
    the least (``nice 19``): the Ray group on the other worker is the critical path, so
    this one only takes the CPU time the Ray tests leave idle (replica starts, health
    checks, waits), and the chaos tests keep the timings they have alone."""
    global _ran_a_ray_test
    if item.get_closest_marker("ray") is not None:
        _ran_a_ray_test = True
    elif not _ran_a_ray_test and os.environ.get("PYTEST_XDIST_WORKER") and os.nice(0) < 19:
        os.nice(19 - os.nice(0))


@pytest.fixture(autouse=True)
def _ray_only_in_ray_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves Ray running must be a Ray test (see ``RAY_FIXTURES``): else
    it could run on the other worker beside the Ray group's cluster."""
    yield
    ray = sys.modules.get("ray")
    if (ray is not None and request.node.get_closest_marker("ray") is None
            and ray.is_initialized()):
        pytest.fail(f"Ray is running after {request.node.nodeid}, which is not marked "
                    "'ray': it, or a test before it on this worker, left Ray started")
