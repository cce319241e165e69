"""``LLM.beam_search``: equal to Hugging Face beam search on real checkpoints, EOS
and length handling, validation, and a pool back at baseline afterwards."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from pagedserve.cluster import LLM, BeamSearchParams, EngineConfig, SamplingParams
from pagedserve.cluster.async_engine import AsyncEngine
from pagedserve.cluster.beam_search import get_beam_search_score
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

PROMPTS = [[5, 17, 99, 3, 42, 7], list(range(8, 45)), [300, 2, 301]]


def hf_beams(model_dir: str, prompt: list[int], width: int, new_tokens: int,
             adapter_dir: str | None = None) -> tuple[list[list[int]], list[float]]:
    """HF beam search with EOS switched off (every beam runs ``new_tokens``), through
    PEFT when ``adapter_dir`` is given: the ``width`` sequences, best first, and their
    cumulative log-probabilities."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    model.generation_config.eos_token_id = None
    x = torch.tensor([prompt])
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width,
                           num_return_sequences=width, do_sample=False,
                           max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
                           length_penalty=1.0, output_scores=True,
                           return_dict_in_generate=True)
    seqs = [row[len(prompt):].tolist() for row in y.sequences]
    # HF scores divide by the generated length; every beam has new_tokens of them.
    return seqs, [float(s) * new_tokens for s in y.sequences_scores]


def assert_beams_equal_hf(model_dir: str, prompt: list[int], width: int, new_tokens: int,
                          **llm_kw) -> None:
    """``LLM.beam_search`` on ``model_dir`` (built with ``llm_kw``) gives HF's beams and
    scores, and leaves the pool at baseline."""
    llm = LLM(model=model_dir, **llm_kw)
    try:
        out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(
            beam_width=width, max_tokens=new_tokens, ignore_eos=True))[0]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    ref_tokens, ref_logprobs = hf_beams(model_dir, prompt, width, new_tokens)
    assert [s.completion_token_ids for s in out.sequences] == ref_tokens
    for seq, ref in zip(out.sequences, ref_logprobs, strict=True):
        assert seq.cum_logprob == pytest.approx(ref, abs=1e-3)


@pytest.mark.parametrize(("arch", "block_size"), [("llama", 16), ("qwen2", 16), ("llama", 4)])
def test_beams_equal_hf_beam_search(arch: str, block_size: int, tiny_llama_dir: str,
                                    tiny_qwen2_dir: str) -> None:
    """Block size 4 shares and copies partial blocks far more often (forked beams
    write into a shared partial block most steps); the beams must not change."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    llm = LLM(model=model_dir, num_gpu_blocks=1024, block_size=block_size)
    try:
        params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref_tokens, ref_logprobs = hf_beams(model_dir, prompt, 4, 12)
        assert [s.completion_token_ids for s in out.sequences] == ref_tokens
        for seq, ref in zip(out.sequences, ref_logprobs, strict=True):
            assert seq.tokens[:len(prompt)] == prompt and seq.finish_reason == "length"
            assert seq.cum_logprob == pytest.approx(ref, abs=1e-3)
            chosen = [lp[t] for lp, t in zip(seq.logprobs, seq.completion_token_ids)]
            assert sum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-9)


def test_beams_under_a_lora_adapter_equal_hf_peft(tiny_llama_dir: str, llama_loras) -> None:
    lora = llama_loras["all7"]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=256)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]], params,
                               lora_request=lora)
        base = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, params)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        ref_tokens, _ = hf_beams(tiny_llama_dir, prompt, 3, 8, lora.lora_path)
        assert [s.completion_token_ids for s in out.sequences] == ref_tokens
    assert [s.completion_token_ids for s in base[0].sequences] != \
        [s.completion_token_ids for s in outs[0].sequences]  # the adapter mattered


@pytest.fixture(scope="module")
def big_pool_beams(tiny_llama_dir: str) -> list[list[list[int]]]:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=1024, block_size=4)
    try:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], SMALL_POOL_PARAMS)
    finally:
        llm.shutdown()
    return [[s.completion_token_ids for s in o.sequences] for o in outs]


SMALL_POOL_PARAMS = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_small_pool_gives_the_same_beams(mode: str, tiny_llama_dir: str,
                                           big_pool_beams: list[list[list[int]]]) -> None:
    """Too few blocks and seats for all twelve beams: beams are preempted (swapped or
    recomputed) and held beams evicted, yet every beam equals the big pool's."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=14, block_size=4, max_num_seqs=5,
              preemption_mode=mode)
    try:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], SMALL_POOL_PARAMS)
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    assert [[s.completion_token_ids for s in o.sequences] for o in outs] == big_pool_beams


def test_beams_share_the_batch_and_cancel_cleanly(tiny_llama_dir: str,
                                                  big_pool_beams: list[list[list[int]]]
                                                  ) -> None:
    """In the async engine a beam search runs alongside plain generation (both answers
    unchanged), and cancelling one mid-search frees its blocks."""
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=256,
                                          block_size=4))
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

            async def generate(prompt: list[int]) -> list[int]:
                last = None
                async for out in engine.generate(prompt, greedy):
                    last = out
                return last.outputs[0].token_ids

            alone = await generate(PROMPTS[2])
            beams, together = await asyncio.gather(
                engine.beam_search(PROMPTS[0], SMALL_POOL_PARAMS), generate(PROMPTS[2]))
            assert [s.completion_token_ids for s in beams] == big_pool_beams[0]
            assert together == alone
            long = BeamSearchParams(beam_width=4, max_tokens=400, ignore_eos=True)
            task = asyncio.create_task(engine.beam_search(PROMPTS[1], long))
            while engine.engine.scheduler.kv.pool.num_free_blocks == 256:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            mem = engine.engine.scheduler.memory_stats()
            assert mem.num_free_blocks == mem.num_gpu_blocks
            assert not engine.engine._groups and not engine.engine.scheduler.requests
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_width_one_is_greedy(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=256)
    try:
        beams = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                                BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
        greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [b.sequences[0].completion_token_ids for b in beams] == \
        [g.outputs[0].token_ids for g in greedy]


def test_chat_answer_ends_at_eos(smol_llm) -> None:
    tok = smol_llm.get_tokenizer()
    ids = list(tok.apply_chat_template([{"role": "user", "content":
                                         "What is the capital of France?"}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    out = smol_llm.beam_search({"prompt_token_ids": ids},
                               BeamSearchParams(beam_width=3, max_tokens=24))[0]
    best = out.sequences[0]
    assert tok.decode(best.completion_token_ids, skip_special_tokens=True) == \
        "The capital of France is Paris."
    assert best.finish_reason == "stop" and best.tokens[-1] in smol_llm.engine.eos_token_ids
    assert best.text == tok.decode(best.tokens)  # vLLM's: the prompt included
    eos = smol_llm.engine.eos_token_ids
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos) for s in out.sequences]
    assert len(out.sequences) == 3 and scores == sorted(scores, reverse=True)
    assert_pool_at_baseline(smol_llm)


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=2.5), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty"),
])
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_prompts_raise_and_leave_nothing_queued(smol_llm) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        smol_llm.beam_search({"prompt_token_ids": []}, params)
    with pytest.raises(ValueError, match="vocabulary"):
        smol_llm.beam_search({"prompt_token_ids": [1, 10**9]}, params)
    too_long = [1] * smol_llm.engine.max_model_len
    with pytest.raises(ValueError, match="at least one token must be generated"):
        smol_llm.beam_search({"prompt_token_ids": too_long}, params)
    with pytest.raises(ValueError, match="BeamSearchParams only"):
        smol_llm.engine.add_request([1, 2], SamplingParams(), beam=params)
    assert_pool_at_baseline(smol_llm)
