"""When an engine replica sends a request's tokens (``pace_deltas``), without Ray."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pagedserve.cluster.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.wire import (
    MAX_STREAM_INTERVAL_S,
    DeltaTracker,
    SampleDelta,
    StreamPacer,
    pace_deltas,
)


def _snap(k: int, total: int) -> RequestOutput:
    """Cumulative snapshot after ``k`` of ``total`` tokens (token i has text chr(97+i))."""
    ids = list(range(k))
    text = "".join(chr(97 + i) for i in ids)
    out = CompletionOutput(0, text, ids, finish_reason="length" if k == total else None)
    return RequestOutput("r", None, [1, 2], [out], finished=k == total)


async def _engine(total: int, gaps: dict[int, float] | None = None,
                  log: list[str] | None = None) -> AsyncIterator[RequestOutput]:
    try:
        for k in range(1, total + 1):
            await asyncio.sleep((gaps or {}).get(k, 0.0))
            if log is not None:
                log.append(f"step{k}")
            yield _snap(k, total)
    finally:
        if log is not None:
            log.append("closed")


async def _collect(interval: float | None, total: int, gaps: dict[int, float] | None = None,
                   log: list[str] | None = None) -> list[list[SampleDelta]]:
    msgs = []
    async for deltas, _ in pace_deltas(_engine(total, gaps, log), DeltaTracker(1), interval):
        msgs.append(deltas)
        if log is not None:
            log.append(f"sent{sum(len(d.token_ids) for d in deltas)}")
    return msgs


def _tokens(msgs: list[list[SampleDelta]]) -> list[list[int]]:
    return [[t for d in m for t in d.token_ids] for m in msgs]


def test_every_step_when_interval_is_zero() -> None:
    msgs = asyncio.run(_collect(0.0, 5))
    assert _tokens(msgs) == [[0], [1], [2], [3], [4]]
    assert msgs[-1][0].finish_reason == "length"


def test_non_streaming_gets_one_message_at_the_end() -> None:
    msgs = asyncio.run(_collect(None, 6))
    assert _tokens(msgs) == [[0, 1, 2, 3, 4, 5]]
    assert msgs[0][0].text == "abcdef" and msgs[0][0].finish_reason == "length"


def test_long_interval_sends_first_token_then_merges_the_rest() -> None:
    msgs = asyncio.run(_collect(60.0, 6))
    assert _tokens(msgs) == [[0], [1, 2, 3, 4, 5]]
    assert "".join(d.text for m in msgs for d in m) == "abcdef"


def test_held_tokens_leave_when_the_interval_ends_not_with_the_next_step() -> None:
    """Step 3 is slow (a long prefill in the batch): token 1 must not wait for it."""
    log: list[str] = []
    t0 = time.monotonic()
    msgs = asyncio.run(_collect(0.05, 3, gaps={3: 0.5}, log=log))
    assert _tokens(msgs) == [[0], [1], [2]]
    assert log.index("sent1") < log.index("step3")  # the held token went out first
    assert time.monotonic() - t0 < 2.0


def test_closing_early_closes_the_engine_stream() -> None:
    """A client gone mid-stream: closing the pacer aborts the request (source closed)."""
    log: list[str] = []

    async def main() -> None:
        gen = pace_deltas(_engine(10, {2: 0.2}, log), DeltaTracker(1), 0.0)
        first = await anext(gen)
        assert [t for d in first[0] for t in d.token_ids] == [0]
        task = asyncio.ensure_future(anext(gen))  # waiting on the slow step 2
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()

    asyncio.run(main())
    assert log[-1] == "closed" and "step2" not in log


def test_pacer_stretches_the_interval_to_keep_the_replica_budget() -> None:
    pacer = StreamPacer(0.05, budget_per_s=100.0)
    assert pacer.interval() == 0.05  # no stream open: the floor
    with pacer.streaming() as interval:
        assert pacer.active == 1 and interval() == 0.05
        opened = [pacer.streaming() for _ in range(31)]
        for cm in opened:
            cm.__enter__()
        assert interval() == pytest.approx(0.32)  # 32 streams share 100 messages/s
        for cm in opened:
            cm.__exit__(None, None, None)
        assert interval() == 0.05
    assert pacer.active == 0


def test_pacer_caps_the_stretch_and_can_be_switched_off() -> None:
    busy = StreamPacer(0.05, budget_per_s=10.0)
    busy.active = 1000
    assert busy.interval() == MAX_STREAM_INTERVAL_S  # streams still move once a second
    slow_floor = StreamPacer(2.0, budget_per_s=10.0)
    slow_floor.active = 1000
    assert slow_floor.interval() == 2.0  # an operator's floor above the cap wins
    off = StreamPacer(0.05, budget_per_s=0.0)
    off.active = 1000
    assert off.interval() == 0.05
    with pytest.raises(ValueError, match="budget"):
        StreamPacer(0.05, -1.0)
    with pytest.raises(ValueError, match="interval"):
        StreamPacer(-0.05, 1.0)


def test_interval_is_read_afresh_so_pacing_follows_load() -> None:
    """A callable interval: long while busy (tokens merge), zero once load drops."""
    current = [60.0]

    async def engine() -> AsyncIterator[RequestOutput]:
        async for out in _engine(8):
            if len(out.outputs[0].token_ids) == 4:
                current[0] = 0.0  # the other streams closed while step 4 ran
            yield out

    async def main() -> list[list[SampleDelta]]:
        return [d async for d, _ in pace_deltas(engine(), DeltaTracker(1), lambda: current[0])]

    msgs = asyncio.run(main())
    # Tokens 1-3 are held under the long interval; once it drops, step 4 flushes them
    # and every later step goes out on its own.
    assert _tokens(msgs) == [[0], [1, 2, 3], [4], [5], [6], [7]]


def test_checkpoints_hold_the_first_tokens_too_and_send_the_rest_per_interval() -> None:
    """A checkpointed non-streamed request: nobody waits for its first token, so it waits
    an interval like the rest (and held tokens wait for the next step, not a timer);
    every token still arrives once, the last with the end."""
    async def main() -> list[list[SampleDelta]]:
        return [d async for d, _ in pace_deltas(
            _engine(9, {k: 0.03 for k in range(1, 10)}), DeltaTracker(1), 0.2,
            checkpoints=True)]

    msgs = asyncio.run(main())
    toks = _tokens(msgs)
    assert [t for m in toks for t in m] == list(range(9))
    assert 2 <= len(msgs) < 9 and len(toks[0]) >= 2  # ~0.27 s of steps, 0.2 s apart
    assert msgs[-1][-1].finish_reason == "length"
    assert "".join(d.text for m in msgs for d in m) == "abcdefghi"
    short = asyncio.run(_collect_checkpointed(60.0, 4))
    assert _tokens(short) == [[0, 1, 2, 3]]  # shorter than an interval: one message


async def _collect_checkpointed(interval: float, total: int) -> list[list[SampleDelta]]:
    return [d async for d, _ in pace_deltas(_engine(total), DeltaTracker(1), interval,
                                            checkpoints=True)]


def test_checkpoint_interval_keeps_the_budget_without_stretching_streams() -> None:
    pacer = StreamPacer(0.05, budget_per_s=100.0, checkpoint_s=1.0)
    with pacer.checkpointing() as every:
        assert every is not None and every() == 1.0 and pacer.checkpoints == 1
        pacer.checkpoints += 299
        assert every() == pytest.approx(3.0)  # 300 requests share 100 messages/s
        assert pacer.interval() == 0.05  # streams are not slowed by them
        pacer.checkpoints -= 299
    assert pacer.checkpoints == 0
    with StreamPacer(0.05, 100.0, checkpoint_s=0.0).checkpointing() as off:
        assert off is None  # checkpoints off: one message at the end
    with pytest.raises(ValueError, match="checkpoint"):
        StreamPacer(0.05, 1.0, checkpoint_s=-1.0)
