"""Suffix decoding (``speculative_config={"method": "suffix"}``) through the real
engine: greedy outputs equal plain decoding and Hugging Face (chunked prefill, both
preemption modes), seeded sampling draws plain decoding's tokens, an answer asked
for again is guessed from the cached first answer in far fewer steps than tokens,
and the pool returns to its baseline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths
from tests.cluster.test_spec_decode import CHATS

SUFFIX = {"method": "suffix"}


@pytest.fixture(scope="module")
def smol_suffix(default_model_dir: str) -> Iterator[LLM]:
    llm = LLM(num_gpu_blocks=256, max_num_seqs=32, speculative_config=SUFFIX)
    yield llm
    llm.shutdown()


def test_default_model_asked_twice_equals_plain_decoding_in_few_steps(smol_llm,
                                                                     smol_suffix) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, logprobs=1)
    plain = [smol_llm.chat(m, params)[0].outputs[0] for m in CHATS]
    engine = smol_suffix.engine
    runs = []
    for _ in range(2):
        steps0 = engine.stats["steps"]
        runs.append(([smol_suffix.chat(m, params)[0].outputs[0] for m in CHATS],
                     engine.stats["steps"] - steps0))
    for outs, _ in runs:
        for a, b in zip(outs, plain):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text,
                                                              b.finish_reason)
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t] - lb[t]) < 1e-3 for t in la)
    n_tokens = sum(len(o.token_ids) for o in plain)
    # The first round quotes its prompts; the second repeats its cached answers.
    assert runs[0][1] < 0.8 * n_tokens, runs[0][1]
    assert runs[1][1] < 0.35 * n_tokens, (runs[1][1], n_tokens)
    stats = engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > n_tokens, stats
    assert_pool_at_baseline(smol_suffix)


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prompts, guesses trimmed to the budget
    {"num_gpu_blocks": 20, "preemption_mode": "recompute"},
    {"num_gpu_blocks": 20, "preemption_mode": "swap"},
])
def test_random_model_greedy_equals_hugging_face(tiny_llama_dir, kw) -> None:
    prompts = prompts_of_mixed_lengths()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = hf_greedy(tiny_llama_dir, prompts, 24)
    llm = LLM(model=tiny_llama_dir, block_size=4, max_num_seqs=8,
              **{"num_gpu_blocks": 64, **kw}, speculative_config=SUFFIX)
    try:
        for _ in range(2):  # the second time, from the cached responses
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 24
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_seeded_sampling_draws_plain_decodings_tokens(tiny_llama_dir) -> None:
    prompts = [list(range(100 + 9 * i, 108 + 9 * i)) * (2 + i) for i in range(3)]
    seeded = SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=20, ignore_eos=True,
                            n=2)
    plain = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        ref = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, seeded)]
    finally:
        plain.shutdown()
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64, speculative_config=SUFFIX)
    try:
        for _ in range(2):
            got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, seeded)]
            assert got == ref
        assert llm.engine.get_stats()["spec_decode"]["num_drafts"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bad_suffix_config_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        LLM(speculative_config={"method": "suffix", "suffix_decoding_min_token_prob": 2})
