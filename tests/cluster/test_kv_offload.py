"""KV offloading through the real engine: a pool too small for the conversations
keeps their evicted prefixes on the CPU tier and loads them back, with the
tokens of a run that computes everything."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def conversations() -> list[list[int]]:
    """Three conversations of three turns, visited round-robin: each turn is the
    previous turn's prompt plus new tokens, after the other conversations ran."""
    systems = [[(53 * c + 7 * j) % 3000 + 200 for j in range(70)] for c in range(3)]
    turns: list[list[int]] = []
    for t in range(3):
        for c, system in enumerate(systems):
            system.extend((11 * t + 5 * c + 3 * j) % 2000 + 100 for j in range(9))
            turns.append(list(system))
    return turns


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt at a time, as turns of a chat arrive."""
    return [llm.generate({"prompt_token_ids": p}, PARAMS, use_tqdm=False)[0]
            .outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=256, enable_prefix_caching=False)
    try:
        return run(llm, conversations())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_offloaded_prefixes_come_back_with_the_same_tokens(mode, tiny_llama_dir,
                                                           reference) -> None:
    # 10 blocks of 16: one conversation's turn fits, the next one evicts it.
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=10, num_offload_blocks=40,
              preemption_mode=mode, block_size=16)
    try:
        assert run(llm, conversations()) == reference
        stats = llm.engine.get_stats()
        off = stats["kv_offload"]
        assert off["enabled"] and off["offloaded_blocks"] > 0 and off["loaded_blocks"] > 0
        assert off["cpu_hit_tokens"] == 16 * off["loaded_blocks"]
        mem = stats["memory"]
        assert mem["num_free_blocks"] == mem["num_gpu_blocks"]
        assert mem["num_swapped_blocks"] == 0 and mem["num_cpu_cached_blocks"] > 0
        assert llm.reset_prefix_cache() > 0
        assert llm.engine.get_stats()["memory"]["num_cpu_cached_blocks"] == 0
    finally:
        llm.shutdown()


def test_offloading_saves_prompt_computation(tiny_llama_dir) -> None:
    hits = {}
    for blocks in (0, 40):
        llm = LLM(model=tiny_llama_dir, num_gpu_blocks=10, num_offload_blocks=blocks,
                  block_size=16)
        try:
            run(llm, conversations())
            s = llm.engine.get_stats()
            hits[blocks] = s["prefix_cache_hits"] + s["kv_offload"]["cpu_hit_tokens"]
        finally:
            llm.shutdown()
    # Without the CPU tier a turn finds little (the other conversations evicted its
    # own); with it, each of the six later turns finds at least its previous turn's
    # four full prompt blocks.
    assert hits[40] - hits[0] >= 6 * 4 * 16, hits


def test_sleep_forgets_the_offloaded_blocks(tiny_llama_dir, reference) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=10, num_offload_blocks=40, block_size=16)
    try:
        prompts = conversations()
        assert run(llm, prompts[:4]) == reference[:4]
        assert llm.engine.get_stats()["memory"]["num_cpu_cached_blocks"] > 0
        llm.sleep(1)
        llm.wake_up()
        assert llm.engine.get_stats()["memory"]["num_cpu_cached_blocks"] == 0
        assert run(llm, prompts[4:]) == reference[4:]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"kv_offloading_size": -1.0}, "kv_offloading_size"),
    ({"kv_offloading_size": True}, "kv_offloading_size"),
    ({"num_offload_blocks": -2}, "num_offload_blocks"),
    ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "enable_prefix_caching"),
])
def test_bad_offloading_settings_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_a_size_that_holds_no_block_is_refused(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(model=tiny_llama_dir, num_gpu_blocks=10, kv_offloading_size=1e-9)
