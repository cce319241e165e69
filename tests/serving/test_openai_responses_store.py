"""Stored responses over HTTP (``--enable-responses-store``) on the default model, two
ingress replicas sharing one store, read with the ``openai`` client:
``previous_response_id`` continues the stored conversation (the answer equals the
chat completion of the whole conversation), ``GET`` / ``DELETE`` / ``input_items``
follow OpenAI, background responses are polled to the foreground answer (streamed
ones resume after a lost connection), and a cancel or delete mid-generation stops
it and frees the engine's blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serving.conftest import SMOL_ARGS, App, Cluster, wait_for
from tests.serving.test_openai_api import MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def stored(cluster: Cluster) -> Iterator[App]:
    app = cluster.deploy("stored", {**SMOL_ARGS, "enable_responses_store": True,
                                    "ingress_replicas": 2})
    yield app
    cluster.delete("stored")


def _get(app: App, path: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{app.base}/v1/responses/{path}", params=params, headers=app.headers,
                     timeout=60)


def _create(app: App, **kw: Any) -> Any:
    return app.openai().responses.create(model=MODEL, temperature=0, **kw)


def test_a_conversation_continues_from_the_stored_response(stored: App) -> None:
    first = _create(stored, instructions="Answer briefly.",
                    input="My name is Ada and I like green. Say hello.", max_output_tokens=16)
    assert first.store is True and first.status in ("completed", "incomplete")
    second = _create(stored, previous_response_id=first.id, input="What is my name?",
                     max_output_tokens=16)
    assert second.previous_response_id == first.id
    # The same answer as the chat completion of the whole conversation; instructions are
    # not carried over (OpenAI's rule), so the second turn has no system message.
    chat = stored.openai().chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16, messages=[
            {"role": "user", "content": "My name is Ada and I like green. Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    third = _create(stored, previous_response_id=second.id, input="And my colour?",
                    max_output_tokens=16)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_get_input_items_and_delete_follow_openai(stored: App) -> None:
    client = stored.openai()
    made = _create(stored, input="What is the capital of France?", max_output_tokens=20,
                   metadata={"k": "v"})
    # Any ingress replica answers: the store is shared (several calls reach both).
    for _ in range(6):
        got = client.responses.retrieve(made.id)
        assert got.model_dump() == made.model_dump()
    items = client.responses.input_items.list(made.id)
    (item,) = items.data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert item.content[0].text == "What is the capital of France?"
    # Streamed, the final event's response is what is stored.
    events = list(client.responses.create(model=MODEL, input="Hi!", temperature=0,
                                          max_output_tokens=8, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    # Deleted: gone for GET and for a conversation that names it.
    assert client.responses.delete(made.id) is None  # the client reads the 200 body
    r = _get(stored, made.id)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        _create(stored, previous_response_id=made.id, input="And Italy?")
    assert e.value.body["param"] == "previous_response_id"
    # store: false is not kept.
    kept = _create(stored, input="Hi!", max_output_tokens=4, store=False)
    assert kept.store is False and _get(stored, kept.id).status_code == 404


def test_a_background_response_is_polled_to_the_foreground_answer(stored: App) -> None:
    client = stored.openai()
    queued = _create(stored, input="What is the capital of France?", max_output_tokens=20,
                     background=True)
    assert queued.status in ("queued", "in_progress") and queued.background is True
    done = wait_for(lambda: (r := client.responses.retrieve(queued.id)).status == "completed"
                    and r, 60, "the background response to finish", 0.2)
    fore = _create(stored, input="What is the capital of France?", max_output_tokens=20)
    assert done.output_text == fore.output_text == "The capital of France is Paris."
    assert done.usage.output_tokens == fore.usage.output_tokens
    # Finished responses do not cancel; foreground ones never do.
    for rid in (queued.id, fore.id):
        r = httpx.post(f"{stored.base}/v1/responses/{rid}/cancel", headers=stored.headers,
                       timeout=30)
        assert r.status_code == 400, r.text
    # A background response continues a conversation like any other.
    nxt = _create(stored, previous_response_id=queued.id, input="And Italy?",
                  max_output_tokens=12)
    assert nxt.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_a_streamed_background_response_resumes_after_a_lost_connection(stored: App) -> None:
    """The client drops the stream after a few events; generation goes on, and a GET
    with ``stream`` and ``starting_after`` (on either ingress replica) continues from
    the next event to the end: together, the foreground answer."""
    client = stored.openai()
    seen = []
    with client.responses.create(model=MODEL, input="What is the capital of France?",
                                 temperature=0, max_output_tokens=20, background=True,
                                 stream=True) as events:
        for ev in events:
            seen.append(ev)
            if ev.type == "response.output_text.delta" and len(seen) >= 6:
                break  # the connection closes here
    rid = seen[0].response.id
    assert seen[0].type == "response.created" and seen[0].response.background is True
    done = wait_for(lambda: client.responses.retrieve(rid).status == "completed", 60,
                    "the background response to finish after the client left")
    rest = list(client.responses.retrieve(rid, stream=True,
                                          starting_after=seen[-1].sequence_number))
    every = seen + rest
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert every[-1].type == "response.completed"
    text = "".join(e.delta for e in every if e.type == "response.output_text.delta")
    fore = _create(stored, input="What is the capital of France?", max_output_tokens=20)
    assert text == every[-1].response.output_text == fore.output_text
    assert client.responses.retrieve(rid).model_dump() == every[-1].response.model_dump()
    assert done
    # From the start, the whole stream again; a response not streamed has no events.
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(every)))
    r = _get(stored, f"{fore.id}", stream="true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


@pytest.mark.parametrize("how", ["cancel", "delete"])
def test_cancel_or_delete_stops_a_background_response_and_frees_its_blocks(
        stored: App, how: str) -> None:
    client = stored.openai()
    bg = _create(stored, input="Count to a thousand.", max_output_tokens=900,
                 background=True, extra_body={"ignore_eos": True})
    wait_for(lambda: client.responses.retrieve(bg.id).status == "in_progress", 60,
             "the background response to start")
    # in_progress is written as the ingress sends it; the engine admits it a step later
    wait_for(lambda: sum(s["num_running"] for s in stored.stats().values()) == 1, 30,
             "the engine to run it")
    t0 = time.monotonic()
    if how == "cancel":
        cancelled = client.responses.cancel(bg.id)
        assert cancelled.status == "cancelled"
        assert client.responses.cancel(bg.id).status == "cancelled"  # idempotent
    else:
        client.responses.delete(bg.id)
    stored.wait_baseline(timeout=20)  # the engine aborted it and freed its blocks
    assert time.monotonic() - t0 < 20
    if how == "cancel":  # the cancel stands: the answer is never written over it
        got = client.responses.retrieve(bg.id)
        assert got.status == "cancelled" and got.output == []
    else:
        assert _get(stored, bg.id).status_code == 404


def test_bad_store_requests_are_openai_errors(stored: App, smol: App) -> None:
    r = _get(stored, "resp_nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    r = _get(stored, "resp_nope/input_items")
    assert r.status_code == 404
    made = _create(stored, input="Hi!", max_output_tokens=4)
    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "nope"}, "after")):
        r = _get(stored, f"{made.id}/input_items", **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{stored.base}/v1/responses", headers=stored.headers, timeout=30,
                   json={"model": MODEL, "input": "hi", "background": True, "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    # Without the store (the default app): every stored-response route is a 404 saying so.
    for path in ("resp_x", "resp_x/input_items"):
        r = _get(smol, path)
        assert r.status_code == 404 and "--enable-responses-store" in r.text
    r = httpx.post(f"{smol.base}/v1/responses/resp_x/cancel", headers=smol.headers,
                   timeout=30)
    assert r.status_code == 404


def test_a_background_response_whose_ingress_replica_dies_reads_failed(stored: App) -> None:
    """Chaos: the replica generating it is killed; the other answers it as failed (no
    eternal in_progress), and the engine ends the orphaned request."""
    import ray
    from ray import serve

    client = stored.openai()
    bg = _create(stored, input="Count to a thousand.", max_output_tokens=900,
                 background=True, extra_body={"ignore_eos": True})
    wait_for(lambda: client.responses.retrieve(bg.id).status == "in_progress", 60,
             "the background response to start")
    store = serve.get_deployment_handle("ResponseStore", app_name="stored")
    owner = store.call.remote("owner", bg.id).result()["ok"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith(f"#OpenAIServer#{owner}")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    t0 = time.monotonic()
    failed = wait_for(lambda: (r := _get(stored, bg.id)).status_code == 200
                      and r.json()["status"] == "failed" and r.json(), 60,
                      "the orphaned response to read failed")
    assert owner in failed["error"]["message"] and time.monotonic() - t0 < 40
    # The engine pings the dead ingress and aborts its request: not 900 tokens later.
    stored.wait_baseline(timeout=30)
    finished = sum(s["server"]["finished"].get("abort", 0) for s in stored.stats().values())
    assert finished >= 1


def test_concurrent_background_responses_end_each_their_own_way(stored: App) -> None:
    """Four at once, two streamed: one cancelled, one deleted, one followed to the end
    after its client left, one polled; each ends as told, the others are untouched,
    and the engine returns to baseline."""
    client = stored.openai()

    def start(n: int, stream: bool = False) -> str:
        kw = dict(model=MODEL, input=f"Count to {n}.", temperature=0, background=True,
                  max_output_tokens=120, extra_body={"ignore_eos": True})
        if not stream:
            return client.responses.create(**kw).id
        with client.responses.create(stream=True, **kw) as events:
            return next(iter(events)).response.id  # then the client leaves

    ids = [start(10), start(20, stream=True), start(30), start(40, stream=True)]
    wait_for(lambda: all(client.responses.retrieve(r).status == "in_progress" for r in ids),
             60, "all four to start")
    stats = httpx.get(f"{stored.base}/v1/stats", headers=stored.headers, timeout=30).json()
    assert stats["responses_store"]["background_running"] == 4
    assert stats["responses_store"]["events_kept"] >= 2  # the streamed ones' first events
    assert client.responses.cancel(ids[0]).status == "cancelled"
    client.responses.delete(ids[3])
    for rid in ids[1:3]:
        wait_for(lambda rid=rid: client.responses.retrieve(rid).status == "incomplete", 120,
                 f"{rid} to run to max_output_tokens")
    followed = list(client.responses.retrieve(ids[1], stream=True))
    assert followed[-1].type == "response.incomplete"
    assert followed[-1].response.usage.output_tokens == 120
    assert client.responses.retrieve(ids[2]).usage.output_tokens == 120
    assert client.responses.retrieve(ids[0]).status == "cancelled"
    assert _get(stored, ids[3]).status_code == 404
    stored.wait_baseline(timeout=30)
    metrics = httpx.get(f"{stored.base}/metrics", timeout=30).text
    assert "pagedserve_responses_store_background_running 0.0" in metrics
    assert "pagedserve_responses_store_entries " in metrics
