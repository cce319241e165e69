"""``kv_cache_dtype``: a narrower KV pool through the real engine.

The same byte budget holds 2x (fp16 / bf16) or 4x (fp8) the blocks of an fp32
pool; block moves stay exact (swap and recompute preemption and prefix-cache hits
give the tokens of an unconstrained run in the same cache dtype); fp16 keys and values
keep the default model's greedy tokens; bad names fail naming the field.
"""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.serve_args import ServeArgs
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

NAMES = {"auto": "float32", "fp8": "fp8_e4m3"}  # what model_info reports
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_one_byte_budget_holds_two_and_four_times_the_blocks(tiny_llama_dir) -> None:
    blocks, per_block = {}, {}
    for kv in ("auto", "bfloat16", "float16", "fp8", "fp8_e5m2"):
        llm = LLM(model=tiny_llama_dir, kv_cache_memory_bytes=4 << 20, kv_cache_dtype=kv,
                  swap_space_bytes=1 << 20)
        try:
            info = llm.engine.model_info
            blocks[kv] = llm.engine.scheduler.memory_stats().num_gpu_blocks
            per_block[kv] = info["bytes_per_block"]
            assert info["kv_cache_dtype"] == NAMES.get(kv, kv)
            kc = llm.engine.executor.worker.kv_cache  # local executor: this process's rank
            assert kc.key_caches[0].element_size() == 4 * per_block[kv] // per_block["auto"]
            assert kc.cpu_key_caches[0].dtype == kc.key_caches[0].dtype
            assert _tokens(llm, ["a short prompt"]) and llm.engine.scheduler.requests == {}
        finally:
            llm.shutdown()
    assert per_block["bfloat16"] * 2 == per_block["float16"] * 2 == per_block["auto"]
    assert per_block["fp8"] * 4 == per_block["fp8_e5m2"] * 4 == per_block["auto"]
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks["auto"]
    assert blocks["fp8"] == blocks["fp8_e5m2"] == 4 * blocks["auto"]


@pytest.fixture(scope="module")
def fp8_reference(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=256, kv_cache_dtype="fp8")
    try:
        return _tokens(llm, prompts_of_mixed_lengths())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_forced_preemption_over_fp8_gives_the_same_tokens(mode, tiny_llama_dir,
                                                          fp8_reference) -> None:
    """Swap moves fp8 blocks as bytes; recompute rewrites them from the same values."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=12, preemption_mode=mode,
              num_cpu_blocks=64 if mode == "swap" else 0, max_num_batched_tokens=64,
              kv_cache_dtype="fp8")
    try:
        assert _tokens(llm, prompts_of_mixed_lengths()) == fp8_reference
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_prefix_hits_read_the_same_fp8_blocks(tiny_llama_dir, fp8_reference) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=256, kv_cache_dtype="fp8")
    try:
        prompts = prompts_of_mixed_lengths()
        assert _tokens(llm, prompts) == fp8_reference
        hits = llm.engine.scheduler.kv.prefix_hits
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == fp8_reference
        assert llm.engine.scheduler.kv.prefix_hits > hits
        assert max(o.num_cached_tokens for o in again) >= 16
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_default_model_answers_the_same_over_narrow_caches() -> None:
    """fp16 K/V keep fp32's greedy tokens here; fp8 still answers the chat prompt."""
    prompts = ["The history of Rome", "def fibonacci(n):", "List three colours:",
               "Once upon a time in a small village"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answers, tokens = {}, {}
    for kv in ("auto", "float16", "fp8"):
        llm = LLM(kv_cache_dtype=kv, kv_cache_memory_bytes=32 << 20)
        try:
            tokens[kv] = _tokens(llm, prompts, params)
            answers[kv] = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16),
                                   use_tqdm=False)[0].outputs[0].text
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()
    assert tokens["float16"] == tokens["auto"]
    assert answers == dict.fromkeys(answers, "The capital of France is Paris.")


def test_bad_kv_cache_dtypes_name_the_field() -> None:
    for bad in ("int4", "fp8_e4m3fnuz", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            ServeArgs(kv_cache_dtype=bad, device="cpu").settings()
    assert EngineConfig(kv_cache_dtype="FP8").kv_cache_dtype == "FP8"
    settings = ServeArgs(kv_cache_dtype="fp8_e5m2", device="cpu").settings()
    assert settings.engine_kwargs["kv_cache_dtype"] == "fp8_e5m2"



def test_calculated_kv_scales_come_from_start_up_calibration(tiny_llama_dir) -> None:
    """The engine embeds a fixed text as its first step, which sets the scales: every
    replica gets the same ones whatever request comes first, later requests never
    change them, and the pool is back at baseline with nothing counted as served."""
    scales = []
    for first in ([5, 6], prompts_of_mixed_lengths()[-1]):  # a probe-sized first request
        llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64, kv_cache_dtype="fp8",
                  calculate_kv_scales=True)
        try:
            model = llm.engine.executor.worker.model
            assert not model.kv_scales_pending
            assert llm.engine.stats["prompt_tokens"] == 0
            assert_pool_at_baseline(llm)
            before = [(a.k_scale.item(), a.v_scale.item()) for a in model.attention_layers()]
            assert all(ks != 1.0 and vs != 1.0 for ks, vs in before)
            _tokens(llm, [first])
            assert _tokens(llm, prompts_of_mixed_lengths()) == _tokens(
                llm, prompts_of_mixed_lengths())
            assert [(a.k_scale.item(), a.v_scale.item())
                    for a in model.attention_layers()] == before
            scales.append(before)
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()
    assert scales[0] == scales[1]
    plain = LLM(model=tiny_llama_dir, num_gpu_blocks=64, kv_cache_dtype="bfloat16",
                calculate_kv_scales=True)  # only fp8 pools use scales
    try:
        assert all(a.k_scale is None for a in plain.engine.executor.worker.model
                   .attention_layers())
    finally:
        plain.shutdown()
