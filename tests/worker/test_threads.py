"""The forward's OpenMP team size in whichever thread runs it.

OpenMP thread counts are per calling thread. Under Ray, OMP_NUM_THREADS is
the actor's CPU count, so a forward run from the async engine's thread pool
got a one-thread team for MKL and oneDNN even after ``torch.set_num_threads``
in the main thread.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest
import torch

from pagedserve.worker.worker import _apply_threads_here

_GOMP = Path(torch.__file__).parent / "lib" / "libgomp.so.1"


@pytest.mark.skipif(not _GOMP.exists(), reason="torch without its bundled GNU OpenMP")
def test_a_pool_thread_gets_the_configured_team() -> None:
    gomp = ctypes.CDLL(str(_GOMP))
    seen: dict[str, int] = {}

    def run() -> None:
        gomp.omp_set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a new thread
        seen["before"] = gomp.omp_get_max_threads()
        _apply_threads_here(3)
        seen["after"] = gomp.omp_get_max_threads()

    saved = torch.get_num_threads()
    torch.set_num_threads(3)  # in the main thread only
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(saved)
    assert seen == {"before": 1, "after": 3}
