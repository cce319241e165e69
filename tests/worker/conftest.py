"""Worker test fixtures: an isolated converted-model cache and the shared SmolLM2 resolve."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def pagedserve_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh converted-model cache for this session, so the first-convert path is exercised."""
    path = tmp_path_factory.mktemp("pagedserve_cache")
    old = os.environ.get("PAGEDSERVE_CACHE_DIR")
    os.environ["PAGEDSERVE_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("PAGEDSERVE_CACHE_DIR", None)
    else:
        os.environ["PAGEDSERVE_CACHE_DIR"] = old
