"""A decode replica's bound on remote prefills in flight (``remote_prefill_max_inflight``),
without Ray: past the bound a prompt is computed locally (``overflow``), and a
finished or failed remote prefill frees its place."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedserve.cluster.disagg import RemotePrefillConfig, RemotePrefiller
from pagedserve.cluster.wire import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams


class _Payload:
    nbytes = 10


class _Pool:
    """A prefill pool whose answers wait until released (or fail when told)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0
        self.fail = False

    @property
    def prefill(self) -> Any:
        return self

    def remote(self, req: EngineRequest) -> Any:
        self.calls += 1
        pool = self

        class _Response:
            def __await__(self) -> Any:
                return self._answer().__await__()

            async def _answer(self) -> dict[str, Any]:
                await pool.release.wait()
                return {"error": "boom"} if pool.fail else {"kv": _Payload()}

            def cancel(self) -> None:
                pass

        return _Response()


class _Engine:
    async def import_kv(self, payload: Any) -> int:
        return 2


def _req(k: int) -> EngineRequest:
    return EngineRequest(f"r{k}", list(range(100)), SamplingParams(max_tokens=1))


def test_past_the_bound_prompts_are_computed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        pool = _Pool()
        pd = RemotePrefiller(pool, RemotePrefillConfig(min_tokens=1, max_inflight=2))
        monkeypatch.setattr(pd, "wanted", lambda *a: True)
        waiting = [asyncio.ensure_future(pd.run(_Engine(), _req(k), None)) for k in range(2)]
        await asyncio.sleep(0)
        assert pd.inflight == 2
        await pd.run(_Engine(), _req(2), None)  # returns at once: computed here
        assert (pool.calls, pd.stats["overflow"]) == (2, 1)
        pool.release.set()
        await asyncio.gather(*waiting)
        assert pd.inflight == 0 and pd.stats["remote_prefills"] == 2
        pool.fail = True  # a failed one frees its place too
        await pd.run(_Engine(), _req(3), None)
        assert pd.inflight == 0 and pd.stats["failures"] == 1 and pool.calls == 3

        unbounded = RemotePrefiller(_Pool(), RemotePrefillConfig(min_tokens=1))
        monkeypatch.setattr(unbounded, "wanted", lambda *a: True)
        many = [asyncio.ensure_future(unbounded.run(_Engine(), _req(k), None))
                for k in range(5)]
        await asyncio.sleep(0)
        assert unbounded.inflight == 5 and unbounded.stats["overflow"] == 0
        for t in many:
            t.cancel()
        await asyncio.gather(*many, return_exceptions=True)
        assert unbounded.inflight == 0

    asyncio.run(run())


def test_the_bound_is_checked() -> None:
    with pytest.raises(ValueError, match="remote_prefill_max_inflight"):
        RemotePrefillConfig(max_inflight=0)
