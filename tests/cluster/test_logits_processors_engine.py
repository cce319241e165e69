"""Custom logits processors through the engine (``LLM(logits_processors=...)``):
per-request settings in ``extra_args``, Hugging Face's ``no_repeat_ngram_size`` as
the oracle for one that reads prompt and output ids, refusals by field."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing_logits import NoRepeatNgramProcessor, TargetTokenProcessor
from tests.cluster.conftest import hf_greedy

PROMPTS = [[(i * 37 + 11) % 4000 + 100 for i in range(12)],
           [(i * 53 + 7) % 4000 + 100 for i in range(7)],
           [(i * 19 + 3) % 4000 + 100 for i in range(20)]]


def greedy(**extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                          extra_args=dict(extra) or None)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> Iterator[LLM]:
    engine = LLM(tiny_llama_dir, num_gpu_blocks=64, logits_processors=[
        TargetTokenProcessor, "pagedserve.worker.testing_logits:NoRepeatNgramProcessor"])
    yield engine
    engine.shutdown()


def test_target_token_rows_and_untouched_rows_share_a_batch(llm: LLM,
                                                            tiny_llama_dir: str) -> None:
    plain = LLM(tiny_llama_dir, num_gpu_blocks=64)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], greedy())]
    finally:
        plain.shutdown()
    params = [greedy(target_token=42), greedy(), greedy(target_token=7)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert outs[0].outputs[0].token_ids == [42] * 16
    assert outs[1].outputs[0].token_ids == want[1]
    assert outs[2].outputs[0].token_ids == [7] * 16
    sampled = SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3,
                             extra_args={"target_token": 99})
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, sampled)[0]
    assert [s.token_ids for s in out.outputs] == [[99] * 8, [99] * 8]


def test_no_repeat_ngram_equals_hugging_face(llm: LLM, tiny_llama_dir: str) -> None:
    """The adapter's callable reads the prompt and the live output ids; Hugging Face's
    ``no_repeat_ngram_size`` over the same ids is the oracle."""
    want = hf_greedy(tiny_llama_dir, PROMPTS, 16, no_repeat_ngram_size=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        greedy(no_repeat_ngram_size=2))
    assert [o.outputs[0].token_ids for o in outs] == want
    free = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    assert [o.outputs[0].token_ids for o in free] != want  # the ban changed something


def test_preempted_requests_keep_their_processor_state(tiny_llama_dir: str) -> None:
    want = hf_greedy(tiny_llama_dir, PROMPTS, 24, no_repeat_ngram_size=2)
    engine = LLM(tiny_llama_dir, num_gpu_blocks=5, block_size=16,
                 preemption_mode="recompute", logits_processors=[NoRepeatNgramProcessor])
    try:
        outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                              extra_args={"no_repeat_ngram_size": 2}))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.engine.scheduler.num_preemptions["recompute"] > 0
    finally:
        engine.shutdown()


def test_bad_settings_are_refused_by_field(llm: LLM, tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match=r"extra_args\.target_token must be an integer"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                     [greedy(), greedy(target_token="x")])
    assert not llm.engine.has_unfinished_requests()  # the batch's first was withdrawn
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be an integer >= 1"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(no_repeat_ngram_size=0))
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        LLM(tiny_llama_dir, logits_processors=[TargetTokenProcessor],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="logits_processors: cannot load 'nope:X'"):
        LLM(tiny_llama_dir, logits_processors=["nope:X"])
