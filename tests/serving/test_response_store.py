"""The responses store's rules without Ray (milliseconds): conversations follow the
links, the bound drops the least recently used finished record, cancel and delete
release a background response's wait, and a cancel is never overwritten."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.response_store import ResponseStore


def _resp(rid: str, status: str = "completed", text: str = "") -> dict[str, Any]:
    out = [{"id": f"msg_out_{rid}", "type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": text}]}] if text else []
    return {"id": rid, "object": "response", "status": status, "output": out}


def _items(rid: str, text: str) -> list[dict[str, Any]]:
    return [{"id": f"msg_in_{rid}", "type": "message", "role": "user",
             "content": [{"type": "input_text", "text": text}]}]


def _texts(items: list[dict[str, Any]]) -> list[str]:
    return [i["content"][0]["text"] for i in items]


def test_a_conversation_is_every_earlier_turn_oldest_first() -> None:
    s = ResponseStore()
    s.put(_resp("r1", text="A1"), _items("r1", "Q1"), None)
    s.put(_resp("r2", text="A2"), _items("r2", "Q2"), "r1")
    s.put(_resp("r3", text="A3"), _items("r3", "Q3"), "r2")
    assert _texts(s.conversation("r3")) == ["Q1", "A1", "Q2", "A2", "Q3", "A3"]
    assert _texts(s.conversation("r1")) == ["Q1", "A1"]
    s.put(_resp("r2b", text="B2"), _items("r2b", "Q2b"), "r1")  # a branch
    assert _texts(s.conversation("r2b")) == ["Q1", "A1", "Q2b", "B2"]
    s.delete("r1")
    with pytest.raises(APIError) as e:
        s.conversation("r3")
    assert (e.value.status, e.value.param) == (404, "previous_response_id")
    assert "'r1'" in e.value.message


def test_the_bound_drops_the_least_recently_used_finished_record() -> None:
    s = ResponseStore(max_entries=2)
    s.put(_resp("a"), [], None)
    s.put(_resp("running", "in_progress"), [], None, background=True)
    s.get("a")  # used: "running" is older now, but a running record is kept
    s.put(_resp("b"), [], None)
    assert set(s.records) == {"running", "b"}
    s.get("running")
    s.put(_resp("c"), [], None)
    assert set(s.records) == {"running", "c"}
    assert s.update(_resp("running"))  # finished: now it may go
    s.put(_resp("d"), [], None)
    assert len(s.records) == 2
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(0)


def test_cancel_releases_the_wait_and_wins_over_the_answer() -> None:
    async def run() -> None:
        s = ResponseStore()
        s.put(_resp("bg", "queued"), [], None, background=True)
        waiting = asyncio.ensure_future(s.wait_cancelled("bg"))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert s.update(_resp("bg", "in_progress"))
        assert not waiting.done()
        assert s.cancel("bg")["status"] == "cancelled"
        assert await waiting is True
        assert s.cancel("bg")["status"] == "cancelled"  # idempotent
        assert not s.update(_resp("bg", text="late"))  # the answer lost the race
        assert s.get("bg")["status"] == "cancelled" and s.get("bg")["output"] == []

        s.put(_resp("done", "queued"), [], None, background=True)
        waiting = asyncio.ensure_future(s.wait_cancelled("done"))
        await asyncio.sleep(0)
        assert s.update(_resp("done", text="ok"))
        assert await waiting is False  # finished, not cancelled
        with pytest.raises(APIError, match="completed"):
            s.cancel("done")

        s.put(_resp("gone", "in_progress"), [], None, background=True)
        waiting = asyncio.ensure_future(s.wait_cancelled("gone"))
        await asyncio.sleep(0)
        s.delete("gone")
        assert await waiting is True
        assert not s.update(_resp("gone", text="late"))
        assert "gone" not in s.records

    asyncio.run(run())


def test_only_background_responses_cancel_and_unknown_ids_are_404() -> None:
    s = ResponseStore()
    s.put(_resp("fg"), [], None)
    with pytest.raises(APIError, match="background"):
        s.cancel("fg")
    for method in (s.get, s.delete, s.cancel, s.input_items):
        with pytest.raises(APIError) as e:
            method("nope")
        assert e.value.status == 404
    s.put(_resp("run", "in_progress"), [], None, background=True)
    with pytest.raises(APIError, match="still in_progress"):
        s.conversation("run")


def test_input_items_page_like_openai() -> None:
    s = ResponseStore()
    items = [{"id": f"i{k}", "type": "message"} for k in range(5)]
    s.put(_resp("r"), items, None)
    page = s.input_items("r", limit=2)
    assert [i["id"] for i in page["data"]] == ["i4", "i3"]
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("i4", "i3", True)
    page = s.input_items("r", limit=2, after="i3")
    assert [i["id"] for i in page["data"]] == ["i2", "i1"]
    page = s.input_items("r", order="asc", after="i2")
    assert [i["id"] for i in page["data"]] == ["i3", "i4"] and not page["has_more"]
    for kw in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "x"}):
        with pytest.raises(APIError):
            s.input_items("r", **kw)


def test_a_background_response_whose_beats_stop_reads_failed() -> None:
    async def run() -> None:
        s = ResponseStore(max_entries=1, stale_s=0.2)
        s.put(_resp("bg", "in_progress"), [], None, background=True, owner="ing1")
        waiting = asyncio.ensure_future(s.wait_cancelled("bg"))
        for _ in range(3):  # beats keep it running past stale_s
            await asyncio.sleep(0.1)
            assert s.beat("bg") and s.get("bg")["status"] == "in_progress"
        assert s.owner("bg") == "ing1"
        await asyncio.sleep(0.3)
        got = s.get("bg")
        assert got["status"] == "failed" and "ing1" in got["error"]["message"]
        await asyncio.wait_for(waiting, 1)  # its task, if alive after all, stops
        assert not s.beat("bg") and not s.update(_resp("bg", text="late"))
        # A stale record does not pin the bound either.
        s.put(_resp("bg2", "in_progress"), [], None, background=True)
        await asyncio.sleep(0.3)
        s.put(_resp("new"), [], None)
        assert list(s.records) == ["new"]

    asyncio.run(run())


def test_streamed_events_are_followed_resumed_and_end() -> None:
    async def run() -> None:
        s = ResponseStore()
        s.put(_resp("bg", "queued"), [], None, background=True, streamed=True)
        assert s.append("bg", ["e0", "e1"])
        assert await s.wait_events("bg", -1, 0.0) == {"events": ["e0", "e1"], "done": False}
        assert (await s.wait_events("bg", 0, 0.0))["events"] == ["e1"]  # starting_after
        waiting = asyncio.ensure_future(s.wait_events("bg", 1, 5.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        s.append("bg", ["e2"])
        assert await waiting == {"events": ["e2"], "done": False}
        waiting = asyncio.ensure_future(s.wait_events("bg", 2, 5.0))
        await asyncio.sleep(0)
        assert s.update(_resp("bg", text="ok"), ["e3", "done"])  # the end, atomically
        assert await waiting == {"events": ["e3", "done"], "done": True}
        assert await s.wait_events("bg", 4, 5.0) == {"events": [], "done": True}
        assert s.stats() == {"entries": 1, "max_entries": 10_000, "background_running": 0,
                             "events_kept": 5}
        assert not s.append("bg", ["late"])
        # A timeout returns nothing new; a cancel or a delete ends the followers.
        s.put(_resp("c", "in_progress"), [], None, background=True, streamed=True)
        assert await s.wait_events("c", -1, 0.05) == {"events": [], "done": False}
        waiting = asyncio.ensure_future(s.wait_events("c", -1, 5.0))
        await asyncio.sleep(0)
        s.cancel("c")
        assert await waiting == {"events": [], "done": True}
        s.put(_resp("d", "in_progress"), [], None, background=True, streamed=True)
        waiting = asyncio.ensure_future(s.wait_events("d", -1, 5.0))
        await asyncio.sleep(0)
        s.delete("d")
        with pytest.raises(APIError) as e:
            await waiting
        assert e.value.status == 404
        # Only streamed background responses keep events.
        s.put(_resp("plain"), [], None)
        with pytest.raises(APIError, match="background and stream") as e:
            await s.wait_events("plain", -1, 0.0)
        assert e.value.param == "stream"

    asyncio.run(run())


def test_ended_streams_drop_their_events_after_a_while(monkeypatch: Any) -> None:
    import pagedserve.cluster.response_store as rs

    async def run() -> None:
        s = ResponseStore()
        s.put(_resp("bg", "in_progress"), [], None, background=True, streamed=True)
        s.update(_resp("bg", text="ok"), ["e0"])
        monkeypatch.setattr(rs, "EVENTS_KEEP_S", 0.0)
        await asyncio.sleep(0.01)
        s.put(_resp("next"), [], None)  # a put purges what has been kept long enough
        assert s.get("bg")["status"] == "completed"
        with pytest.raises(APIError, match="no longer kept"):
            await s.wait_events("bg", -1, 0.0)

    asyncio.run(run())
