"""The ingress's HTTP counters: a plain ASGI middleware, no Ray needed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedserve.cluster.metrics import HttpMetrics, HttpMetricsMiddleware


def _call(app: Any, path: str, sent: list[dict[str, Any]]) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "path": path, "method": "POST"}, receive, send))


def test_streamed_response_is_in_flight_until_its_last_chunk() -> None:
    metrics = HttpMetrics()
    seen_in_flight: list[int] = []

    async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        for i in range(3):
            seen_in_flight.append(metrics.in_flight)
            await send({"type": "http.response.body", "body": b"x", "more_body": i < 2})
        seen_in_flight.append(metrics.in_flight)

    sent: list[dict[str, Any]] = []
    _call(HttpMetricsMiddleware(streaming_app, metrics), "/v1/completions", sent)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert seen_in_flight == [1, 1, 1, 1]
    assert metrics.in_flight == 0
    assert metrics.responses == {("/v1/completions", 201): 1}


def test_a_crashing_handler_counts_as_500_and_still_raises() -> None:
    metrics = HttpMetrics()

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _call(HttpMetricsMiddleware(broken, metrics), "/v1/chat/completions", [])
    assert metrics.in_flight == 0
    assert metrics.responses == {("/v1/chat/completions", 500): 1}


def test_lifespan_passes_through_uncounted() -> None:
    metrics = HttpMetrics()
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["type"])

    async def run() -> None:
        await HttpMetricsMiddleware(app, metrics)({"type": "lifespan"}, None, None)

    asyncio.run(run())
    assert calls == ["lifespan"] and metrics.responses == {} and metrics.in_flight == 0
