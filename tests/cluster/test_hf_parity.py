"""Greedy tokens equal Hugging Face ``generate`` on the same weights."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.cluster.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts_of_mixed_lengths(n: int = 6) -> list[list[int]]:
    return [[(37 * i + 11 * j) % 4000 + 100 for j in range(3 + 9 * i)] for i in range(n)]


def test_default_model_chat_answer_equals_hugging_face(smol_llm, default_model_dir) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    out = smol_llm.chat(messages, params)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    tok = smol_llm.get_tokenizer()
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    ref = hf_greedy(default_model_dir, [ids], 20, ignore_eos=False)[0]
    assert out.outputs[0].token_ids == ref


def test_default_model_mixed_batch_equals_hugging_face(smol_llm, default_model_dir) -> None:
    prompts = ["The quick brown fox", "In 1492, Columbus",
               "def fibonacci(n):\n    ", "Paris is the capital of"]
    tok = smol_llm.get_tokenizer()
    ids = [tok.encode(p) for p in prompts]
    outs = smol_llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(default_model_dir, ids, 12)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_random_checkpoint_batch_equals_hugging_face(kind, tiny_llama_dir, tiny_qwen2_dir
                                                     ) -> None:
    path = tiny_llama_dir if kind == "llama" else tiny_qwen2_dir
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(path, prompts, 12)
    llm = LLM(model=path, num_gpu_blocks=128)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        # The same prompts again: every full prompt block is a prefix-cache hit.
        hits_before = llm.engine.scheduler.kv.prefix_hits
        again = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == ref
        assert llm.engine.scheduler.kv.prefix_hits > hits_before
        assert max(o.num_cached_tokens for o in again) >= 16
    finally:
        llm.shutdown()


def test_chunked_prefill_equals_hugging_face(tiny_llama_dir) -> None:
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(tiny_llama_dir, prompts, 12)
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=128, max_num_batched_tokens=8,
              max_num_seqs=4)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
    finally:
        llm.shutdown()
