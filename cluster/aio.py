"""asyncio helpers shared by the engine and the ingress (no engine or Ray imports)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather_or_cancel(calls: list[Awaitable[T]]) -> list[T]:
    """Every call's answer, in order; the first failure (or a cancellation) cancels the
    others, waits for them to end, and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
