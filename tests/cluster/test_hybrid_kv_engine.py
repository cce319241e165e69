"""Hybrid models through the engine: one block table per KV cache group
(``scheduler.kv_groups``, ``scheduler.hybrid_kv``), sliding groups releasing what
falls behind their window, every token Hugging Face's.

The model is a random Gemma 3 of six layers, five sliding over 16 tokens and one
full (the release's 5 : 1), so its six groups are one layer each: a 300-token
request holds 19 blocks of the full layer and 2-3 of each sliding one, not 19 of
all six.
"""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

WINDOW = 16
LONG = [5 + (7 * i) % 300 for i in range(300)]


@pytest.fixture(scope="module")
def gemma_5to1_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("gemma_5to1"), "gemma3_text", default_model_dir,
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])


@pytest.fixture(scope="module")
def refs(gemma_5to1_dir: str) -> dict[str, list[list[int]]]:
    return {"mixed": hf_greedy(gemma_5to1_dir, prompts_of_mixed_lengths(), 24),
            "long": hf_greedy(gemma_5to1_dir, [LONG], 40)}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_groups_and_their_bytes(gemma_5to1_dir: str) -> None:
    """Six groups of one layer: a block is one layer's, six times the blocks of the
    same bytes (KV offloading keeps the groups); off, one table again."""
    llm = LLM(model=gemma_5to1_dir, kv_cache_memory_bytes=40 * 6 * 4096)
    try:
        info = llm.engine.model_info
        assert info["kv_group_windows"] == [None] + [WINDOW] * 5
        assert llm.engine.scheduler.kv.group_windows == (None,) + (WINDOW,) * 5
        hybrid_blocks = llm.engine.scheduler.kv.pool.num_blocks
    finally:
        llm.shutdown()
    llm = LLM(model=gemma_5to1_dir, kv_cache_memory_bytes=40 * 6 * 4096,
              kv_offloading_size=0.01)
    try:
        assert llm.engine.scheduler.kv.group_windows == (None,) + (WINDOW,) * 5
        assert llm.engine.scheduler.kv.offload_enabled
    finally:
        llm.shutdown()
    llm = LLM(model=gemma_5to1_dir, kv_cache_memory_bytes=40 * 6 * 4096,
              disable_hybrid_kv_cache_manager=True)
    try:
        assert llm.engine.model_info["kv_group_windows"] is None
        assert llm.engine.scheduler.kv.group_windows == (None,)
        assert llm.engine.scheduler.kv.pool.num_blocks * 6 == hybrid_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=8, max_num_seqs=4),
    dict(num_gpu_blocks=40, preemption_mode="swap", max_num_batched_tokens=16, max_num_seqs=4),
    dict(num_gpu_blocks=40, preemption_mode="recompute", max_num_batched_tokens=16,
         max_num_seqs=4),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    dict(attention_backend="torch"),
], ids=["chunked", "swap", "recompute", "ngram", "torch-backend"])
def test_group_tables_give_hugging_faces_tokens(gemma_5to1_dir: str, refs, kw: dict) -> None:
    """Chunked prefill, preemption in a pool too small for the batch (every group's
    table swapped out and back, or recomputed), n-gram drafts, the torch path; then the
    same prompts again as prefix-cache hits; the pool back to empty after each run."""
    kw = {"num_gpu_blocks": 256, **kw}
    llm = LLM(model=gemma_5to1_dir, **kw)
    try:
        prompts = prompts_of_mixed_lengths()
        for _ in range(2):
            outs = llm.generate(prompts, _greedy(24))
            assert [o.outputs[0].token_ids for o in outs] == refs["mixed"]
            stats = llm.engine.scheduler.memory_stats()
            assert stats.num_used_blocks == 0
        if "preemption_mode" in kw:
            assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
        else:
            assert max(o.num_cached_tokens for o in outs) >= 16
    finally:
        llm.shutdown()


def test_a_long_request_fits_where_one_table_would_not(gemma_5to1_dir: str, refs) -> None:
    """The same KV bytes: 300 + 40 tokens need 22 blocks of all six layers, more than
    the 20 such blocks there are; in groups, 22 of the full layer and at most 6 of each
    sliding one (52 of the 120 one-layer blocks). Its tokens are Hugging Face's, and
    ``n=2`` samples share every group's prompt blocks."""
    kw = dict(max_num_batched_tokens=64, max_num_seqs=4)
    one = LLM(model=gemma_5to1_dir, num_gpu_blocks=20, disable_hybrid_kv_cache_manager=True,
              **kw)
    try:
        budget = 20 * int(one.engine.model_info["bytes_per_block"])
        with pytest.raises(ValueError, match="KV blocks"):
            one.generate([LONG], _greedy(40))
    finally:
        one.shutdown()
    llm = LLM(model=gemma_5to1_dir, kv_cache_memory_bytes=budget, **kw)
    try:
        sched = llm.engine.scheduler
        assert sched.kv.pool.num_blocks == 120
        out = llm.generate([LONG], _greedy(40))[0]
        assert out.outputs[0].token_ids == refs["long"][0]
        two = llm.generate([LONG], SamplingParams(n=2, temperature=0.0, max_tokens=40,
                                                  ignore_eos=True))[0]
        assert [s.token_ids for s in two.outputs] == refs["long"] * 2
        assert sched.memory_stats().num_used_blocks == 0
    finally:
        llm.shutdown()


def test_peak_blocks_follow_the_window(gemma_5to1_dir: str) -> None:
    """Stepping one long request: each sliding group never holds more than its window
    and a step's blocks, while the full group grows with the sequence."""
    llm = LLM(model=gemma_5to1_dir, num_gpu_blocks=200, max_num_batched_tokens=32,
              max_num_seqs=4)
    try:
        engine = llm.engine
        engine.add_request(LONG, _greedy(40), "long")
        kv = engine.scheduler.kv
        peak = [0] * 6
        while engine.has_unfinished_requests():
            engine.step()
            for g, group in enumerate(kv.group_managers):
                live = [b for b in group.req_blocks.get("long", ()) if b.block_id >= 0]
                peak[g] = max(peak[g], len(live))
        assert peak[0] == 340 // 16 + 1  # the full layer: the whole sequence
        assert max(peak[1:]) <= -(-(WINDOW - 1 + 32) // 16) + 1 == 4
    finally:
        llm.shutdown()


def test_beams_fork_every_groups_table(gemma_5to1_dir: str) -> None:
    """Beam search forks all six tables (4-token blocks: releases in the sliding groups
    and copy-on-write most steps) and equals HF's beam search."""
    from tests.cluster.test_beam_search import assert_beams_equal_hf

    assert_beams_equal_hf(gemma_5to1_dir, prompts_of_mixed_lengths()[3], 3, 24,
                          num_gpu_blocks=512, block_size=4)


def test_prompt_kv_shipped_between_hybrid_engines(gemma_5to1_dir: str, refs) -> None:
    """Disaggregated prefill with KV cache groups: the prefill engine ships every full
    group's blocks of the hit and each sliding group's window before it (not the whole
    prompt six times over); the decode engine hits all of it and answers as Hugging
    Face. An engine with one table refuses the payload by its layout."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
    from tests.cluster.test_kv_transfer import prefill

    prompts = prompts_of_mixed_lengths()
    made = [LLM(model=gemma_5to1_dir, num_gpu_blocks=512, block_size=4) for _ in range(2)]
    try:
        payloads = prefill(made[0], prompts)
        hit = [(len(p) - 1) // 4 for p in prompts]
        assert [p.num_blocks for p in payloads] == [k + 5 * min(k, 4) for k in hit]
        assert payloads[0].layout.kv_group_windows == (None,) + (WINDOW,) * 5
        for p in payloads:
            import_prompt_kv(made[1].engine, p)
        outs = made[1].generate(prompts, _greedy(24))
        assert [o.outputs[0].token_ids for o in outs] == refs["mixed"]
        assert [o.num_cached_tokens for o in outs] == [k * 4 for k in hit]
        for llm in made:
            assert_pool_at_baseline(llm)
    finally:
        for llm in made:
            llm.shutdown()
    one = LLM(model=gemma_5to1_dir, num_gpu_blocks=512, block_size=4,
              disable_hybrid_kv_cache_manager=True)
    try:
        with pytest.raises(ValueError, match="kv_group_windows"):
            import_prompt_kv(one.engine, payloads[-1])
    finally:
        one.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_offloaded_group_blocks_come_back_with_hugging_faces_tokens(gemma_5to1_dir: str,
                                                                   mode: str) -> None:
    """KV offloading with groups: three conversations of three turns, one turn at a
    time, in a pool that holds one turn's prefill (45 one-layer blocks: the full layer's
    and each sliding layer's blocks of the whole chunk); each later turn finds its previous
    turn's blocks evicted to the CPU tier and loads back the full group's prefix and
    each sliding group's window, with the tokens of a run that computes everything."""
    from tests.cluster.test_kv_offload import conversations

    params = _greedy(8)
    turns = conversations()
    ref = hf_greedy(gemma_5to1_dir, turns, 8)
    llm = LLM(model=gemma_5to1_dir, num_gpu_blocks=45, num_offload_blocks=240,
              preemption_mode=mode, block_size=16)
    try:
        assert llm.engine.scheduler.kv.group_windows == (None,) + (WINDOW,) * 5
        got = [llm.generate({"prompt_token_ids": t}, params, use_tqdm=False)[0]
               .outputs[0].token_ids for t in turns]
        assert got == ref
        stats = llm.engine.get_stats()
        off = stats["kv_offload"]
        assert off["offloaded_blocks"] > 0 and off["loaded_blocks"] > 0
        # Each of the six later turns hits at least its previous turn's four full
        # blocks (of 79 or more tokens), from the CPU tier: without it, none (the
        # other conversations' turns evicted them).
        assert off["cpu_hit_tokens"] >= 6 * 4 * 16 and stats["prefix_cache_hits"] == 0, off
        assert stats["memory"]["num_free_blocks"] == stats["memory"]["num_gpu_blocks"]
        assert llm.reset_prefix_cache() > 0
    finally:
        llm.shutdown()
