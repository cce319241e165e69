"""Sliding-window models (Mistral v0.1's layout, Qwen2's ``use_sliding_window``) served
past their window: greedy tokens equal Hugging Face ``generate``, whose sdpa mask lets a
query see its own key and the ``window - 1`` before it.

The random checkpoints have windows of 20 and 12 tokens, prompts of 3-48 tokens and 40
generated tokens, so prompts, chunked prefills, prefix-cache hits, decode and n-gram
draft verification all cross the window. Before windows were read, such a model was
capped at its window (``max_model_len``).
"""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _prompts(n: int = 6) -> list[list[int]]:
    return [[(37 * i + 11 * j) % 4000 + 100 for j in range(3 + 9 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("mistral_window"), "mistral",
                                   default_model_dir, sliding_window=20)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Layer 0 attends to everything, layer 1 through a 12-token window."""
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen2_window"), "qwen2",
                                   default_model_dir, use_sliding_window=True,
                                   sliding_window=12, max_window_layers=1)


@pytest.fixture(scope="module")
def mistral_ref(mistral_dir: str) -> list[list[int]]:
    return hf_greedy(mistral_dir, _prompts(), 40)


def _generate(path: str, prompts: list[list[int]], **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, num_gpu_blocks=128, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mistral_past_its_window_equals_hugging_face(mistral_dir, mistral_ref,
                                                      backend: str) -> None:
    """Native rows and the torch path; then the same prompts as prefix-cache hits."""
    out, llm = _generate(mistral_dir, _prompts(), attention_backend=backend)
    try:
        assert llm.engine.max_model_len == 512  # not capped at the window
        assert out == mistral_ref
        hits = llm.engine.scheduler.kv.prefix_hits
        again = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]
        assert again == mistral_ref and llm.engine.scheduler.kv.prefix_hits > hits
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=8, max_num_seqs=4),
                                dict(speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 3}),
                                dict(batch_invariant=True)],
                         ids=["chunked", "ngram", "batch-invariant"])
def test_mistral_chunks_and_drafts_equal_hugging_face(mistral_dir, mistral_ref,
                                                      kw: dict) -> None:
    """Chunks of 8 tokens over context, verify steps of 4 queries over context, and
    batch-invariant mode (every row through the per-row kernel)."""
    out, llm = _generate(mistral_dir, _prompts(), **kw)
    try:
        assert out == mistral_ref
    finally:
        llm.shutdown()


def test_qwen2_window_on_upper_layers_equals_hugging_face(qwen2_dir) -> None:
    ref = hf_greedy(qwen2_dir, _prompts(), 40)
    out, llm = _generate(qwen2_dir, _prompts())
    try:
        assert [a.self_attn.attn.window for a in llm.engine.executor.worker.model.layers] \
            == [None, 12]
        assert out == ref
    finally:
        llm.shutdown()


def test_blocks_behind_the_window_go_back_to_the_pool(mistral_dir) -> None:
    """Five 16-token blocks (80 tokens) serve two requests of 48 + 150 tokens each:
    every layer slides, so each holds its window's blocks only (a model without a
    window is refused such a request at admission), preempting each other on the way;
    both still equal Hugging Face."""
    prompts = [_prompts()[5], _prompts()[4]]
    ref = hf_greedy(mistral_dir, prompts, 150)
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    llm = LLM(model=mistral_dir, num_gpu_blocks=5, block_size=16, max_num_batched_tokens=16,
              max_num_seqs=2)
    try:
        assert llm.engine.scheduler.kv.sliding_window == 20
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    finally:
        llm.shutdown()


def test_a_window_on_some_layers_gets_a_table_of_its_own(qwen2_dir) -> None:
    """Layer 0 of the Qwen2 file attends to everything: its table keeps every block;
    layer 1's (a KV cache group of its own, ``scheduler.kv_groups``) releases. With
    the hybrid manager off, one table for both releases nothing."""
    for off, groups in ((False, (None, 12)), (True, (None,))):
        llm = LLM(model=qwen2_dir, num_gpu_blocks=64, disable_hybrid_kv_cache_manager=off)
        try:
            assert llm.engine.scheduler.kv.sliding_window is None
            assert llm.engine.scheduler.kv.group_windows == groups
        finally:
            llm.shutdown()


def test_beams_under_a_released_window_equal_hugging_face(mistral_dir) -> None:
    """Beams fork tables whose leading entries were released (4-token blocks, so
    releases and copy-on-write happen most steps) and still equal HF's beam search."""
    from tests.cluster.test_beam_search import assert_beams_equal_hf

    assert_beams_equal_hf(mistral_dir, _prompts()[3], 3, 24, num_gpu_blocks=256, block_size=4)


def test_prompt_kv_shipped_between_windowed_engines(mistral_dir, mistral_ref) -> None:
    """Disaggregated prefill: the prefill engine has released the blocks behind each
    prompt's window (they stay cached), exports the prompts' KV, and the decode engine
    answers as Hugging Face, computing only what it was not sent."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
    from tests.cluster.test_kv_transfer import prefill

    prompts = _prompts()
    made = [LLM(model=mistral_dir, num_gpu_blocks=128, block_size=4) for _ in range(2)]
    try:
        payloads = prefill(made[0], prompts)
        assert [p.num_blocks for p in payloads] == [len(p) // 4 for p in prompts]
        for p in payloads:
            import_prompt_kv(made[1].engine, p)
        outs = made[1].generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == mistral_ref
        assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
        for llm in made:
            assert_pool_at_baseline(llm)
    finally:
        for llm in made:
            llm.shutdown()
