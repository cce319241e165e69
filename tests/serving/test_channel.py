"""The replica-to-ingress channel: one message per step for all of an ingress's requests.

``Outboxes`` is plain asyncio and is tested as such; the end-to-end test drives the real
Serve app and checks that concurrent streams shared messages.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedserve.cluster.channel import Outboxes
from tests.serving.conftest import App


async def _take(gen: object, n: int) -> list[list[object]]:
    return [await anext(gen) for _ in range(n)]  # type: ignore[call-overload]


def test_chunks_wait_for_the_subscriber_and_one_step_goes_out_as_one_message() -> None:
    async def scenario() -> None:
        boxes = Outboxes(idle_s=0.05)
        with boxes.sending("ing") as a, boxes.sending("ing") as b:
            a("a0")  # before anyone subscribed: buffered, not lost
            sub = boxes.subscribe("ing")
            assert await _take(sub, 1) == [["a0"]]
            a("a1")
            b("b1")  # the same step's other stream, added before the subscriber runs
            assert await _take(sub, 1) == [["a1", "b1"]]
            b("b2")
            assert await _take(sub, 1) == [["b2"]]
        assert boxes.stats()["chunks_sent"] == 4 and boxes.stats()["messages_sent"] == 3
        with pytest.raises(StopAsyncIteration):  # idle with nothing in flight: it ends
            await anext(sub)
        await sub.aclose()

    asyncio.run(scenario())


def test_a_subscription_stays_open_while_a_request_is_in_flight() -> None:
    async def scenario() -> None:
        boxes = Outboxes(idle_s=0.02)
        with boxes.sending("ing") as send:
            sub = boxes.subscribe("ing")
            nxt = asyncio.ensure_future(anext(sub))
            await asyncio.sleep(0.1)  # several idle periods pass: still subscribed
            assert not nxt.done()
            send("late")
            assert await nxt == ["late"]
        with pytest.raises(StopAsyncIteration):
            await anext(sub)

    asyncio.run(scenario())


def test_channels_are_separate_and_orphans_are_dropped() -> None:
    async def scenario() -> None:
        boxes = Outboxes(idle_s=0.02, orphan_s=0.05)
        with boxes.sending("x") as x, boxes.sending("y") as y:
            x("x0")
            y("y0")
        assert await _take(boxes.subscribe("y"), 1) == [["y0"]]
        assert boxes.stats()["buffered_chunks"] == 1  # x's chunk waits for x
        time.sleep(0.06)
        with boxes.sending("z"):  # a new channel sweeps the ones nobody came back for
            pass
        assert boxes.stats()["buffered_chunks"] == 0
        assert boxes.stats()["channels"] == 2  # y (its subscriber was never closed) and z

    asyncio.run(scenario())


def test_a_channel_is_abandoned_only_when_its_chunks_wait_unsubscribed_too_long() -> None:
    async def scenario() -> None:
        boxes = Outboxes(idle_s=0.02)
        with boxes.sending("ing") as send:
            sub = boxes.subscribe("ing")
            send("a")
            assert await _take(sub, 1) == [["a"]]
            await sub.aclose()  # the ingress died with a request in flight
            time.sleep(0.03)
            assert not boxes.abandoned("ing", after_s=0.02)  # nothing waiting yet
            send("b")
            assert not boxes.abandoned("ing", after_s=0.02)  # waited too briefly
            time.sleep(0.03)
            assert boxes.abandoned("ing", after_s=0.02)
            sub = boxes.subscribe("ing")  # a live ingress comes back for them
            assert await _take(sub, 1) == [["b"]]
            send("c")
            time.sleep(0.03)
            assert not boxes.abandoned("ing", after_s=0.02)  # subscribed: not abandoned
        assert not boxes.abandoned("nobody")
        with boxes.sending("k"):
            sub = boxes.subscribe("k", owner="ingress-k")
            nxt = asyncio.ensure_future(anext(sub))
            await asyncio.sleep(0)
            assert boxes.watched() == [("k", "ingress-k")]  # in flight: worth a ping
            boxes.mark_owner_dead("k")  # the ping said it died
            assert boxes.abandoned("k") and boxes.watched() == []
            nxt.cancel()
        assert boxes.watched() == []  # nothing in flight: nothing to check

    asyncio.run(scenario())


@pytest.mark.ray
def test_concurrent_streams_share_messages_end_to_end(smol: App) -> None:
    """Eight streams at once through HTTP: fewer channel messages than chunks."""
    (before,) = smol.stats().values()

    async def burst() -> list[str]:
        body = {"prompt": "Count slowly:", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=120) as c:
            async def one() -> str:
                text = ""
                async with c.stream("POST", f"{smol.base}/v1/completions", json=body,
                                    headers=smol.headers) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text
            return list(await asyncio.gather(*(one() for _ in range(8))))

    texts = asyncio.run(burst())
    assert len(set(texts)) == 1 and texts[0]  # greedy: the same text for every stream
    after = smol.wait_baseline()
    (s,) = after.values()
    chunks = s["streams"]["chunks_sent"] - before["streams"]["chunks_sent"]
    messages = s["streams"]["messages_sent"] - before["streams"]["messages_sent"]
    assert chunks >= 8 * 3  # ack, first tokens and the end, at least, per stream
    assert 0 < messages < chunks
    assert s["streams"]["subscribed"] >= 1


@pytest.mark.ray
def test_the_per_request_stream_still_serves_composing_deployments(smol: App) -> None:
    """``EngineServer.generate`` (for apps calling the replica directly): ack, then deltas."""
    from ray import serve

    from pagedserve.cluster.wire import EngineRequest, chunk_from_wire
    from pagedserve.scheduler.sampling_params import SamplingParams

    handle = serve.get_deployment_handle("EngineServer", smol.name).options(stream=True)
    req = EngineRequest("compose-1", list(range(1000, 1012)),
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    chunks = [chunk_from_wire(raw) for raw in handle.generate.remote(req)]
    assert chunks[0].prompt_tokens == 12 and not chunks[0].deltas  # the ack
    assert chunks[-1].finished
    assert sum(len(d.token_ids) for c in chunks for d in c.deltas) == 6
    smol.wait_baseline()


@pytest.mark.ray
def test_an_idle_subscription_ends_and_the_next_request_opens_another(smol: App) -> None:
    """Idle replicas end their subscriptions (nothing holds up their graceful shutdown);
    the next request subscribes again and is served at once."""
    client = smol.openai()
    client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    deadline = time.monotonic() + 30
    while next(iter(smol.stats().values()))["streams"]["subscribed"]:
        assert time.monotonic() < deadline, "the subscription never ended"
        time.sleep(0.2)
    t0 = time.monotonic()
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < 5  # its chunks came over a new subscription
