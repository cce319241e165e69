"""Phi-3 / Phi-4 (``model_type: phi3``): files store ``qkv_proj`` and ``gate_up_proj``
fused; adapters trained on them (PEFT targets the fused names) are served as adapters
on the parts. Greedy tokens equal HF + PEFT's; base rows beside adapter rows equal HF.
LongRoPE with partial rotary (Phi-3.5, Phi-4-mini) equals HF generate."""

from __future__ import annotations

import random

import pytest

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.lora_fixtures import hf_peft_greedy, write_adapter
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_phi3_lora_on_fused_projections_equals_hf_peft(tiny_phi3_dir, tmp_path) -> None:
    adapter = write_adapter(tiny_phi3_dir, tmp_path / "phi_fused", 7, FUSED)
    prompts = prompts_of_mixed_lengths(4)
    ref = hf_peft_greedy(tiny_phi3_dir, adapter, prompts)
    base = hf_peft_greedy(tiny_phi3_dir, None, prompts)
    assert ref != base
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=tiny_phi3_dir, num_gpu_blocks=128, enable_lora=True, max_lora_rank=8)
    try:
        lora = LoRARequest("phi_fused", 1, adapter)
        outs = llm.generate(prompts + prompts, params,
                            lora_request=[lora] * len(prompts) + [None] * len(prompts))
        assert [o.outputs[0].token_ids for o in outs] == ref + base
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def longrope_phi3_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Phi-3.5 / Phi-4-mini's RoPE in small: LongRoPE over a 16-token pre-trained length
    (short and long per-frequency factors, served to 64), half of each head turning."""
    g = random.Random(5)
    rd = 16 // 2  # head size 16, partial_rotary_factor 0.5
    scaling = {"rope_type": "longrope",
               "short_factor": [round(1 + g.random(), 3) for _ in range(rd // 2)],
               "long_factor": [round(2 + 6 * g.random(), 3) for _ in range(rd // 2)]}
    return write_random_checkpoint(
        tmp_path_factory.mktemp("phi3_longrope"), "phi3", default_model_dir,
        max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling=scaling, partial_rotary_factor=0.5)


@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=8, max_num_seqs=4)],
                         ids=["whole", "chunked"])
def test_longrope_and_partial_rotary_equal_hugging_face(longrope_phi3_dir, kw) -> None:
    """Prompts of 3-48 tokens and 14 new ones: prompts past 16 tokens turn by the long
    factors throughout, shorter ones switch to them once the sequence passes 16 (as
    transformers' generate does), in chunks of 8 too (a chunk takes its prompt's
    factors, not its own length's)."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(longrope_phi3_dir, prompts, 14)
    llm = LLM(model=longrope_phi3_dir, num_gpu_blocks=128, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.engine.max_model_len == 64
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [dict(speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 3}),
                                dict(num_gpu_blocks=12, preemption_mode="swap")],
                         ids=["ngram", "swapped"])
def test_longrope_prefix_hits_drafts_and_swaps(longrope_phi3_dir, kw) -> None:
    """The long prompts first, then each prompt's first 12 tokens: the short prompts
    share the long ones' tokens but not their (long-rotated) blocks, and still get
    HF's tokens; n-gram drafts stop short of the switch; a pool of 12 blocks swaps
    sequences out and in across it."""
    prompts = prompts_of_mixed_lengths()
    shorts = [p[:12] for p in prompts if len(p) > 16]
    ref = hf_greedy(longrope_phi3_dir, prompts + shorts, 14)
    llm = LLM(model=longrope_phi3_dir, **{"num_gpu_blocks": 128, **kw})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        first = llm.generate(prompts, params)
        then = llm.generate(shorts, params)
        assert [o.outputs[0].token_ids for o in first + then] == ref
        if "preemption_mode" in kw:
            assert llm.engine.scheduler.num_preemptions["swap"] > 0
    finally:
        llm.shutdown()


def test_longrope_prompt_kv_ships_between_engines(longrope_phi3_dir) -> None:
    """Disaggregated prefill of LongRoPE prompts: long ones ship their long-rotated
    blocks under the long key, short ones theirs; the decode engine answers as HF."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(longrope_phi3_dir, prompts, 14)
    made = [LLM(model=longrope_phi3_dir, num_gpu_blocks=128, block_size=4) for _ in range(2)]
    try:
        payloads = prefill(made[0], prompts)
        assert [p.num_blocks for p in payloads] == [len(p) // 4 for p in prompts]
        for p in payloads:
            import_prompt_kv(made[1].engine, p)
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        outs = made[1].generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    finally:
        for llm in made:
            llm.shutdown()


def test_longrope_beams_cross_the_switch_as_hugging_face(longrope_phi3_dir) -> None:
    """Beams of a 12-token prompt grow past the 16-token length: each is recomputed
    long, and the beams and their scores are HF's beam search."""
    from tests.cluster.test_beam_search import assert_beams_equal_hf

    assert_beams_equal_hf(longrope_phi3_dir, prompts_of_mixed_lengths()[1], 3, 10,
                          num_gpu_blocks=128, block_size=4)


def test_the_routers_prefix_hashes_carry_the_long_key(longrope_phi3_dir) -> None:
    """The router places a prompt by the hashes the replicas' prefix caches use: past
    LongRoPE's pre-trained length those carry the long key, so a long prompt's affinity
    finds the replica holding its long-rotated blocks; a short prompt's do not."""
    from pagedserve.cluster.router import routed_request

    llm = LLM(model=longrope_phi3_dir, num_gpu_blocks=64, block_size=4)
    try:
        engine = llm.engine
        limit = engine.scheduler.cache_config.long_rope_from
        info = {"model_id": engine.model_id, "block_size": 4, "long_rope_from": limit}
        params = SamplingParams(max_tokens=1)
        for n in (limit, limit + 9):
            ids = list(range(100, 100 + n))
            routed = routed_request("r", ids, params, None, info, stream=False)
            assert routed.block_hashes == engine.prompt_block_hashes(ids)
        assert routed_request("r", ids, params, None, {**info, "long_rope_from": 0},
                              stream=False).block_hashes != engine.prompt_block_hashes(ids)
    finally:
        llm.shutdown()
