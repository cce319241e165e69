"""An idle engine's wait for the rest of a burst: the policy, and the engine that follows it."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.cluster import SamplingParams
from pagedserve.cluster.async_engine import AsyncEngine
from pagedserve.cluster.burst import AUTO_MAX_GAP_S, BurstPolicy
from pagedserve.cluster.config import EngineConfig
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths


def test_explicit_wait_is_the_gap_until_a_step_is_full() -> None:
    off = BurstPolicy(0.0, step_token_budget=2048)
    assert not off.enabled and off.quiet_gap(10) == 0.0
    fixed = BurstPolicy(30.0, step_token_budget=2048)
    assert fixed.enabled
    assert fixed.quiet_gap(1) == pytest.approx(0.03)
    assert fixed.quiet_gap(2047) == pytest.approx(0.03)
    assert fixed.quiet_gap(2048) == 0.0  # a full step cannot take more: start it


def test_auto_gap_is_a_share_of_the_measured_step_and_capped() -> None:
    auto = BurstPolicy(None, step_token_budget=2048)
    assert auto.enabled
    assert auto.quiet_gap(128) == 0.0  # nothing measured yet: no wait
    auto.observe_step(8, 5.0)  # decode-sized steps say little about prompt work
    assert auto.seconds_per_token is None
    auto.observe_step(256, 0.512)  # 2 ms a token
    assert auto.quiet_gap(100) == pytest.approx(0.05 * 100 * 0.002)
    assert auto.quiet_gap(1000) == AUTO_MAX_GAP_S
    assert auto.quiet_gap(2048) == 0.0
    auto.observe_step(1000, 0.001)  # a fast device: the estimate follows it down
    assert auto.seconds_per_token < 0.002
    fast = BurstPolicy(None, step_token_budget=2048)
    fast.observe_step(512, 0.005)  # about 10 us a token, as on a GPU
    assert fast.quiet_gap(128) < 1e-4


def run_arrivals(engine: AsyncEngine, prompts: list[list[int]], spacing_s: float
                 ) -> tuple[list[int], list[str]]:
    """Send ``prompts`` ``spacing_s`` apart; the request count of every step, and the texts."""
    sizes: list[int] = []
    execute = engine.engine.execute

    def spy(plan: object) -> object:
        sizes.append(len(plan.scheduled))  # type: ignore[attr-defined]
        return execute(plan)

    engine.engine.execute = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)

    async def consume(prompt: list[int], delay: float) -> str:
        await asyncio.sleep(delay)
        text = ""
        async for out in engine.generate(prompt, params):
            text = out.outputs[0].text
        return text

    async def scenario() -> list[str]:
        try:
            return list(await asyncio.gather(
                *(consume(p, spacing_s * i) for i, p in enumerate(prompts))))
        finally:
            await engine.shutdown()

    texts = asyncio.run(scenario())
    return sizes, texts


@pytest.mark.parametrize("burst_wait_ms", [0.0, 150.0])
def test_idle_async_engine_gathers_a_burst_into_its_first_step(tiny_llama_dir,
                                                                burst_wait_ms) -> None:
    """Requests arriving a few ms apart at an idle engine start as one batch when it waits
    for the burst, and the first one alone starts a step when it does not."""
    engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=64,
                                      burst_wait_ms=burst_wait_ms))
    sizes, texts = run_arrivals(engine, prompts_of_mixed_lengths(4), 0.02)
    assert all(texts)
    assert sizes[0] == (4 if burst_wait_ms else 1), sizes


@pytest.mark.parametrize("seconds_per_token,first_step", [(1.0, 4), (1e-7, 1)])
def test_auto_wait_gathers_for_a_slow_engine_only(tiny_llama_dir, seconds_per_token,
                                                 first_step) -> None:
    """The default sizes the wait from the engine's measured speed: where a first step
    would take seconds it gathers arrivals 5 ms apart; where it takes microseconds it
    starts at once."""
    engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=64))
    assert engine.engine.config.burst_wait_ms is None
    engine.burst.seconds_per_token = seconds_per_token
    engine.burst.observe_step = lambda *_: None  # type: ignore[method-assign]
    sizes, texts = run_arrivals(engine, prompts_of_mixed_lengths(4), 0.005)
    assert all(texts)
    assert sizes[0] == first_step, sizes


def test_no_wait_once_the_waiting_prompt_fills_a_step(tiny_llama_dir) -> None:
    """A second's wait is configured, but the prompt alone fills the step's token budget:
    nothing that arrives later could join that step, so it starts at once."""
    engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=64,
                                      burst_wait_ms=1000.0, max_num_batched_tokens=16))
    prompt = list(range(5, 45))  # 40 tokens, over the 16-token budget

    async def first_token_after() -> float:
        start = time.monotonic()
        try:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=1)):
                return time.monotonic() - start
        finally:
            await engine.shutdown()
        raise AssertionError("no output")

    assert asyncio.run(first_token_after()) < 0.9


def test_burst_wait_defaults_to_auto_and_rejects_bad_values() -> None:
    assert EngineConfig().burst_wait_ms is None
    assert EngineConfig(burst_wait_ms=0).burst_wait_ms == 0
    for bad in (-1.0, 5000.0, "fast", True):
        with pytest.raises(ValueError, match="burst_wait_ms"):
            EngineConfig(burst_wait_ms=bad)
