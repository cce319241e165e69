"""The ingress's embedding calls: retry, error mapping and cancellation.

A scripted stand-in for the Serve handle plays each replica answer (a dead
replica, a 503 that may be retried, a 400, overload, a call that never ends),
since those cannot be produced on demand from a live replica; the live path
is covered in ``test_openai_embeddings.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from pagedserve.cluster.embeddings import embed_all, embed_on_replicas
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.wire import EngineRequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

OK = {"embedding": [1.0, 0.0], "prompt_tokens": 3, "replica": "r2"}


class _Call:
    def __init__(self, outcome: Any) -> None:
        self.outcome, self.cancelled = outcome, False

    def __await__(self):
        return self._run().__await__()

    async def _run(self) -> Any:
        if self.outcome == "hang":
            await asyncio.Event().wait()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedHandle:
    """``handle.options(method_name="embed").remote(req)`` answering from a script."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes, self.calls, self.sent = list(outcomes), [], []

    def options(self, method_name: str) -> ScriptedHandle:
        assert method_name == "embed"
        return self

    def remote(self, req: EngineRequest) -> _Call:
        self.sent.append(req)
        call = _Call(self.outcomes.pop(0))
        self.calls.append(call)
        return call


def _req(i: int = 0) -> EngineRequest:
    return EngineRequest(f"embd-{i}", [5, 6, 7], SamplingParams(max_tokens=1),
                         pooling=PoolingParams())


def test_a_dead_replica_or_a_retryable_503_is_retried_elsewhere() -> None:
    dead = RayActorError(error_msg="replica died")
    busy = {"error": "engine replica failed: x", "status": 503, "retryable": True,
            "replica": "r1"}
    handle = ScriptedHandle([dead, busy, OK])
    assert asyncio.run(embed_on_replicas(handle, _req())) == OK
    assert len(handle.calls) == 3
    assert handle.sent[2].exclude_replicas == ("r1",)  # the replica that failed is avoided


@pytest.mark.parametrize(("outcomes", "status", "calls"), [
    ([{"error": "input is 2000 tokens", "status": 400, "retryable": False,
       "replica": "r1"}], 400, 1),
    ([BackPressureError(num_queued_requests=9, max_queued_requests=8)], 503, 1),
    ([RayActorError()] * 3, 503, 3),
])
def test_errors_become_api_errors(outcomes: list[Any], status: int, calls: int) -> None:
    handle = ScriptedHandle(outcomes)
    with pytest.raises(APIError) as info:
        asyncio.run(embed_on_replicas(handle, _req()))
    assert info.value.status == status and len(handle.calls) == calls


def test_one_failing_input_cancels_the_others() -> None:
    bad = {"error": "dimensions too large", "status": 400, "retryable": False,
           "replica": "r1"}
    handle = ScriptedHandle(["hang", "hang", bad])

    async def run() -> None:
        with pytest.raises(APIError):
            await embed_all(handle, [_req(0), _req(1), _req(2)])

    asyncio.run(run())
    assert [c.cancelled for c in handle.calls] == [True, True, False]


def test_answers_keep_the_inputs_order() -> None:
    answers = [{**OK, "embedding": [float(i)]} for i in range(4)]
    out = asyncio.run(embed_all(ScriptedHandle(answers), [_req(i) for i in range(4)]))
    assert [r["embedding"] for r in out] == [[0.0], [1.0], [2.0], [3.0]]
