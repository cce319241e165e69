"""Speculative decoding (n-gram drafts) through the real engine: greedy outputs equal
plain decoding and Hugging Face, under chunked prefill and both preemption modes,
with penalties, logprobs and stop strings; seeded sampling gives plain decoding's tokens;
the pool returns to its baseline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

# Single-token matches too: random models rarely repeat a bigram of their own.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TEXT = ("The quick brown fox jumps over the lazy dog. Paged attention stores the key value "
        "cache in fixed size blocks so that memory waste stays below four percent, and the "
        "scheduler shares blocks between requests that have the same prefix.")
CHATS = [[{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}"}],
         [{"role": "user", "content": f"Summarize: {TEXT}"}],
         [{"role": "user", "content": "What is the capital of France?"}]]


@pytest.fixture(scope="module")
def smol_spec(default_model_dir: str) -> Iterator[LLM]:
    llm = LLM(num_gpu_blocks=256, max_num_seqs=32, speculative_config=NGRAM)
    yield llm
    llm.shutdown()


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_default_model_greedy_equals_plain_decoding_in_fewer_steps(smol_llm, smol_spec) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, logprobs=1)
    plain = [smol_llm.chat(m, params)[0].outputs[0] for m in CHATS]
    steps0 = smol_spec.engine.stats["steps"]
    spec = [smol_spec.chat(m, params)[0].outputs[0] for m in CHATS]
    steps = smol_spec.engine.stats["steps"] - steps0
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason
        assert len(a.logprobs) == len(a.token_ids)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-3 for t in la)
    stats = smol_spec.engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 20, stats
    assert steps < 0.7 * sum(len(o.token_ids) for o in spec), (steps, stats)
    assert_pool_at_baseline(smol_spec)


def test_a_stop_string_inside_accepted_drafts_cuts_text_and_tokens(smol_llm, smol_spec) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, stop=["four percent"])
    plain = smol_llm.chat(CHATS[0], params)[0].outputs[0]
    spec = smol_spec.chat(CHATS[0], params)[0].outputs[0]
    assert plain.stop_reason == "four percent"
    assert (spec.text, spec.token_ids, spec.stop_reason) == (
        plain.text, plain.token_ids, plain.stop_reason)
    assert_pool_at_baseline(smol_spec)


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prompts, drafts trimmed to the budget
    {"num_gpu_blocks": 20, "preemption_mode": "recompute"},
    {"num_gpu_blocks": 20, "preemption_mode": "swap"},
])
def test_random_model_greedy_equals_hugging_face(tiny_llama_dir, kw) -> None:
    prompts = prompts_of_mixed_lengths()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, block_size=4, max_num_seqs=8,
              **{"num_gpu_blocks": 64, **kw}, speculative_config=NGRAM)
    try:
        assert _tokens(llm.generate(prompts, params)) == hf_greedy(tiny_llama_dir, prompts, 24)
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_penalties_and_seeded_sampling_with_drafts(tiny_llama_dir) -> None:
    # Repeated prompts: the n-gram lookup always finds something to propose.
    prompts = [list(range(100 + 9 * i, 108 + 9 * i)) * (2 + i) for i in range(4)]
    penal = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                           repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=5)
    seeded = SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=20, ignore_eos=True,
                            n=2)
    plain = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        ref = _tokens(plain.generate(prompts, penal))
        ref_seeded = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, seeded)]
    finally:
        plain.shutdown()
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64, speculative_config=NGRAM)
    try:
        assert _tokens(llm.generate(prompts, penal)) == ref
        first = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, seeded)]
        again = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, seeded)]
        assert first == again
        # Seeded draws are keyed by output position, not by how many a step made: the
        # drafts' extra draws change nothing.
        assert first == ref_seeded
        # Sample i of a seeded n=2 request is the lone request with seed + i.
        alone = llm.generate(prompts[:1], SamplingParams(temperature=0.7, top_k=20, seed=10,
                                                         max_tokens=20, ignore_eos=True))
        assert alone[0].outputs[0].token_ids == first[0][1]
        assert llm.engine.get_stats()["spec_decode"]["num_drafts"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bad_speculative_config_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    with pytest.raises(ValueError, match="method"):
        LLM(speculative_config={"method": "medusa"})
