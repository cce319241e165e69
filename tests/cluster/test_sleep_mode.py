"""Sleep mode and new weights: an asleep engine holds no KV pool (level 2: no weights),
refuses requests and wakes to the same answers; ``update_weights`` serves another
checkpoint's tokens exactly, asleep or awake, with LoRA adapters and fp8 KV scales kept;
a busy engine or a checkpoint of another architecture is refused and changes nothing."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.async_engine import AsyncEngine
from pagedserve.cluster.engine_lifecycle import EngineSleepingError
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.lora_fixtures import GREEDY as LORA_GREEDY
from tests.cluster.lora_fixtures import PROMPTS as LORA_PROMPTS
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = prompts_of_mixed_lengths(4)


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY,
           **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, **kw)]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, default_model_dir) -> str:
    """Same architecture as ``tiny_llama_dir``, other weights (an RLHF step's)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("other_llama"), "llama",
                                   default_model_dir, seed=99)


@pytest.fixture(scope="module")
def refs(tiny_llama_dir, other_llama_dir) -> dict[str, list[list[int]]]:
    out = {}
    for name, path in (("base", tiny_llama_dir), ("other", other_llama_dir)):
        llm = LLM(model=path, num_gpu_blocks=64)
        try:
            out[name] = tokens(llm)
        finally:
            llm.shutdown()
    assert out["base"] != out["other"]
    return out


@pytest.mark.parametrize("level", [1, 2])
def test_asleep_holds_no_pool_refuses_requests_and_wakes_to_the_same_answers(
        tiny_llama_dir, refs, level) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        assert tokens(llm) == refs["base"]
        worker = llm.engine.executor.worker
        pool = weakref.ref(worker.kv_cache.key_caches[0])
        weights = weakref.ref(next(worker.model.parameters()))
        llm.sleep(level)
        gc.collect()
        assert pool() is None  # the KV pool's memory is gone
        assert (weights() is None) == (level == 2)  # level 2: the weights too
        assert not llm.engine.scheduler.kv.pool.cached  # no prefix names empty blocks
        with pytest.raises(EngineSleepingError, match="asleep"):
            llm.generate(PROMPTS, GREEDY)
        llm.engine.check_health()  # asleep on purpose is healthy
        with pytest.raises(ValueError, match="already asleep"):
            llm.sleep(1)
        llm.wake_up()
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs["base"]
        assert all(o.num_cached_tokens == 0 for o in outs)  # nothing cached survived
        with pytest.raises(ValueError, match="not asleep"):
            llm.wake_up()
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_busy_engine_and_bad_levels_are_refused(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        engine = llm.engine
        engine.add_request(PROMPTS[-1], GREEDY, "busy")
        engine.step()
        with pytest.raises(ValueError, match="idle engine: 1 requests"):
            llm.sleep(1)
        with pytest.raises(ValueError, match="idle engine"):
            llm.update_weights(tiny_llama_dir)
        engine.step()  # still serving
        engine.abort_request("busy")
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            llm.sleep(3)
        assert engine.unavailable is None
        llm.sleep(1)
        llm.wake_up()
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("asleep", [0, 1, 2])
def test_new_weights_give_the_new_checkpoints_tokens(tiny_llama_dir, other_llama_dir, refs,
                                                     asleep) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        assert tokens(llm) == refs["base"]
        if asleep:
            llm.sleep(asleep)
        llm.update_weights(other_llama_dir)
        if asleep:
            with pytest.raises(EngineSleepingError):
                llm.generate(PROMPTS, GREEDY)
            llm.wake_up()
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs["other"]
        assert all(o.num_cached_tokens == 0 for o in outs)  # no stale prefix hit
        assert llm.engine.model_info["model_path"] == other_llama_dir
        llm.update_weights(tiny_llama_dir)  # and back
        assert tokens(llm) == refs["base"]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_another_architecture_is_refused_and_the_old_weights_keep_serving(
        tiny_llama_dir, tiny_qwen2_dir, refs, tmp_path) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        with pytest.raises(ValueError, match="model_type='qwen2'"):
            llm.update_weights(tiny_qwen2_dir)
        wider = write_random_checkpoint(tmp_path / "wider", "llama", None,
                                        intermediate_size=256)
        with pytest.raises(ValueError, match="intermediate_size=256"):
            llm.update_weights(wider)
        assert llm.engine.unavailable is None
        assert tokens(llm) == refs["base"]
    finally:
        llm.shutdown()


def test_lora_adapters_and_fp8_scales_survive_a_rebuilt_model(
        tiny_llama_dir, llama_loras, llama_refs) -> None:
    lora = llama_loras["all7"]
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64, enable_lora=True, max_lora_rank=8)
    try:
        before = tokens(llm, LORA_PROMPTS, LORA_GREEDY, lora_request=lora)
        assert before == llama_refs["all7"]
        llm.sleep(2)
        llm.wake_up()
        assert tokens(llm, LORA_PROMPTS, LORA_GREEDY, lora_request=lora) == before
        llm.update_weights(tiny_llama_dir)  # awake: the adapters go back on at once
        assert tokens(llm, LORA_PROMPTS, LORA_GREEDY, lora_request=lora) == before
    finally:
        llm.shutdown()
    fp8 = LLM(model=tiny_llama_dir, num_gpu_blocks=64, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    try:
        attn = fp8.engine.executor.worker.model.attention_layers
        scales = [(float(a.k_scale), float(a.v_scale)) for a in attn()]
        assert any(k != 1.0 for k, _ in scales)  # calibrated at start-up
        before = tokens(fp8)
        fp8.sleep(2)
        fp8.wake_up()
        assert [(float(a.k_scale), float(a.v_scale)) for a in attn()] == scales
        assert tokens(fp8) == before
    finally:
        fp8.shutdown()


def test_async_engine_sleeps_and_wakes_between_requests(tiny_llama_dir, other_llama_dir,
                                                        refs) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)

    async def one(aeng: AsyncEngine, prompt: list[int], rid: str) -> list[int]:
        last = None
        async for out in aeng.generate(prompt, GREEDY, rid):
            last = out
        assert last is not None
        return last.outputs[0].token_ids

    async def main() -> None:
        aeng = AsyncEngine(engine=llm.engine)
        try:
            assert await one(aeng, PROMPTS[1], "a") == refs["base"][1]
            await aeng.sleep(2)
            with pytest.raises(EngineSleepingError):
                await one(aeng, PROMPTS[1], "b")
            await aeng.update_weights(other_llama_dir)
            await aeng.wake_up()
            assert await one(aeng, PROMPTS[1], "c") == refs["other"][1]
        finally:
            if aeng._loop_task is not None:
                aeng._loop_task.cancel()
            aeng._step_thread.shutdown(wait=True)
            aeng._transfer_thread.shutdown(wait=True)

    try:
        asyncio.run(main())
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
