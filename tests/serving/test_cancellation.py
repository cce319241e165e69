"""Clients that go away: their requests are aborted in the scheduler, survivors are unchanged.

A stream whose client disconnects, and a non-streaming request whose caller times out,
must stop generating within a step or two (generation_tokens stops growing for them) and
free their blocks: the pool returns to baseline while others keep their exact greedy text.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.serving.conftest import App

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [f"Story number {i}: once upon a time in a small village," for i in range(4)]
MAX_TOKENS = 40
MODEL = "SmolLM2-135M-Instruct"


def _totals(app: App) -> dict[str, Any]:
    (s,) = app.stats().values()
    return s


async def _stream(client: httpx.AsyncClient, app: App, prompt: str, cut_after: int | None
                  ) -> tuple[str, int]:
    """Stream a greedy completion; close the connection after ``cut_after`` chunks.
    Returns the text, the chunks and the tokens received (a paced chunk may carry
    several: its logprobs list them)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 1}
    text, chunks, tokens = "", 0, 0
    async with client.stream("POST", f"{app.base}/v1/completions", json=body,
                             headers=app.headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            tokens += len(choice["logprobs"]["tokens"])
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                break  # leaving the block closes the connection mid-stream
    return text, chunks, tokens


def test_disconnected_streams_are_aborted_and_survivors_unchanged(smol: App) -> None:
    client = smol.openai()
    reference = [client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True}
                                           ).choices[0].text for p in PROMPTS]
    before = smol.wait_baseline()
    (b,) = before.values()

    async def run() -> list[tuple[str, int, int]]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(
                _stream(http, smol, p, 3 if i % 2 == 0 else None)
                for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    for i, (text, chunks, _) in enumerate(results):
        if i % 2:
            assert text == reference[i], i
        else:
            assert chunks == 3 and reference[i].startswith(text)
    after = smol.wait_baseline()
    (a,) = after.values()
    assert a["aborted_requests"] - b["aborted_requests"] == 2
    assert a["server"]["finished"].get("abort", 0) - b["server"]["finished"].get("abort", 0) == 2
    assert a["streams"]["open"] == 0  # the replica's stream pacing forgot them too
    # Nothing kept generating for the two clients that left: each got its 3 chunks'
    # tokens (one to a few each: a chunk carries what the pacing interval gathered), and
    # at most three steps ran for it before the abort landed.
    received = sum(results[i][2] for i in (0, 2))
    generated = a["generation_tokens"] - b["generation_tokens"]
    assert generated <= 2 * MAX_TOKENS + received + 2 * 3, (generated, received)


def test_non_streaming_caller_that_goes_away_is_aborted(smol: App) -> None:
    b = _totals(smol)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{smol.base}/v1/completions", headers=smol.headers, timeout=2.0,
                   json={"prompt": "Tell me everything about the sea.", "max_tokens": 600,
                         "ignore_eos": True})
    (a,) = smol.wait_baseline(timeout=10).values()
    elapsed = time.monotonic() - t0
    assert a["aborted_requests"] == b["aborted_requests"] + 1
    # 600 tokens take far longer than this; the request stopped when its caller left.
    assert a["generation_tokens"] - b["generation_tokens"] < 300
    assert elapsed < 12


def test_server_still_serves_after_cancellations(smol: App) -> None:
    r = smol.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24)
    assert r.choices[0].message.content == "The capital of France is Paris."
    smol.wait_baseline()
