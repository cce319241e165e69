"""Resuming a request from outputs another engine produced (``resumed_token_ids``), the
engine half of mid-stream failover, and ``StreamCursor``, the ingress half.

A request resumed after any number of its tokens ends with the tokens and text of the
uninterrupted run: greedy, seeded (draws keyed by output position), with penalties and
``min_tokens`` (counted from the plan, not from worker state), stop strings, a grammar,
in a batch under swap and recompute preemption. Streamed snapshots never show text a
stop string later removes (a resumed stream repeats exactly what was shown). Bad
resumptions are ``ValueError``s naming the field that leave the pool at baseline.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.beam_search import BeamSearchParams
from pagedserve.cluster.outputs import CompletionOutput
from pagedserve.cluster.resume import StreamCursor, resumable
from pagedserve.cluster.wire import EngineChunk, EngineRequest, SampleDelta
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import StructuredOutputs
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
    "seeded top-p": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40,
                                   ignore_eos=True),
    "seeded penalties min_tokens": SamplingParams(
        temperature=1.0, top_k=50, seed=3, max_tokens=40, min_tokens=30,
        frequency_penalty=0.5, repetition_penalty=1.2),
    "grammar": SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured_outputs=(
        StructuredOutputs(regex=r"[0-9]{3}-[a-z]{4,30}"))),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> Iterator[LLM]:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=128)
    yield llm
    llm.shutdown()


def _run(llm: LLM, params: SamplingParams, resumed: list[int] | None = None,
         prompt: list[int] = PROMPT) -> tuple[CompletionOutput, list[str]]:
    """The final output and every snapshot's text on the way."""
    eng = llm.engine
    rid = eng.add_request(prompt, params, resumed_token_ids=resumed)
    last, texts = None, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid:
                last = out
                texts.append(out.outputs[0].text)
    assert last is not None and last.finished
    return last.outputs[0], texts


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_ends_as_the_uninterrupted_one(llm: LLM, case: str) -> None:
    params = CASES[case]
    full, _ = _run(llm, params)
    assert len(full.token_ids) >= 8
    for k in sorted({1, 2, len(full.token_ids) // 2, len(full.token_ids) - 1}):
        part, _ = _run(llm, params, full.token_ids[:k])
        assert part.token_ids == full.token_ids, (case, k)
        assert part.text == full.text and part.finish_reason == full.finish_reason
        if params.logprobs is not None:  # the resumed ones are not recomputed
            assert part.logprobs[:k] == [{}] * k
            for a, b in zip(part.logprobs[k:], full.logprobs[k:]):
                assert a.keys() == b.keys()
                assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    assert_pool_at_baseline(llm)


def test_resumed_requests_in_a_preempting_batch_end_as_uninterrupted(tiny_llama_dir: str
                                                                     ) -> None:
    prompts = [PROMPT[: 5 + 3 * i] for i in range(6)]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=48, ignore_eos=True)
    roomy = LLM(model=tiny_llama_dir, num_gpu_blocks=128)
    try:
        ref = [o.outputs[0] for o in roomy.generate(prompts, params)]
    finally:
        roomy.shutdown()
    for mode in ("swap", "recompute"):
        llm = LLM(model=tiny_llama_dir, num_gpu_blocks=14, preemption_mode=mode,
                  max_model_len=128)
        try:
            eng = llm.engine
            rids = [eng.add_request(p, params, resumed_token_ids=r.token_ids[: 3 + 7 * i])
                    for i, (p, r) in enumerate(zip(prompts, ref))]
            done = {}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0]
            assert [done[r].token_ids for r in rids] == [r.token_ids for r in ref], mode
            assert [done[r].text for r in rids] == [r.text for r in ref]
            assert sum(eng.scheduler.num_preemptions.values()) > 0, mode
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()


def test_streamed_snapshots_never_show_what_a_stop_string_removes(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full, _ = _run(llm, free)
    tok = llm.engine.tokenizer
    cut = len(tok.decode(full.token_ids[:10]))  # a stop string across a token boundary
    stop = full.text[cut - 2: cut + 3]
    assert len(stop) == 5 and full.text.find(stop) == cut - 2
    stopped = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    out, texts = _run(llm, stopped)
    assert out.text == full.text[: cut - 2] and out.finish_reason == "stop"
    assert len(texts) > 5 and all(out.text.startswith(t) for t in texts), texts
    # Resumed before the stop string completes: its held-back tail is not repeated.
    k = len(out.token_ids) - 1
    part, texts = _run(llm, stopped, out.token_ids[:k])
    assert part.text == out.text and part.token_ids == out.token_ids
    assert all(out.text.startswith(t) for t in texts)
    assert_pool_at_baseline(llm)


def test_bad_resumptions_are_value_errors_naming_the_field(llm: LLM) -> None:
    eng = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    full, _ = _run(llm, greedy)
    bad = [
        (SamplingParams(n=2, max_tokens=8), [1, 2], "n=1"),
        (greedy, [1, 2, 49152], "vocabulary"),
        (greedy, [1, 2, True], "vocabulary"),
        (greedy, full.token_ids, "max_tokens"),
        (SamplingParams(max_tokens=8), [3, eng.eos_token_ids[0], 4], "stop token"),
        (SamplingParams(max_tokens=8, stop_token_ids=[77]), [77], "stop token"),
        (SamplingParams(max_tokens=8, stop=[full.text[:3]]), full.token_ids[:6],
         "stop string"),
    ]
    for params, resumed, what in bad:
        with pytest.raises(ValueError, match=f"resumed_token_ids.*{what}|{what}.*resumed"):
            eng.add_request(PROMPT, params, resumed_token_ids=resumed)
    with pytest.raises(ValueError, match=r"resumed_token_ids.*context"):
        eng.add_request(PROMPT * 30, SamplingParams(max_tokens=None), resumed_token_ids=[1] * 500)
    with pytest.raises(ValueError, match="resumed_token_ids"):
        eng.add_request(PROMPT, None, beam=BeamSearchParams(beam_width=2, max_tokens=4),
                        resumed_token_ids=[1])
    assert_pool_at_baseline(llm)


def _chunk(replica: str, ids: list[int], text: str, finished: bool = False) -> EngineChunk:
    return EngineChunk("r", replica, [SampleDelta(0, text, ids, [{t: -1.0} for t in ids],
                                                  [-1.0] * len(ids),
                                                  "length" if finished else None)],
                       finished=finished)


def test_stream_cursor_drops_the_repeat_of_a_resumed_attempt() -> None:
    req = EngineRequest("r", [1, 2], SamplingParams(max_tokens=10, prompt_logprobs=1))
    assert resumable(req) and resumable(EngineRequest("r", [1], SamplingParams(n=2)))
    assert not resumable(EngineRequest("r", [1], SamplingParams(), pooling=PoolingParams()))
    cur = StreamCursor()
    for c in (_chunk("a", [7, 8], "ab"), _chunk("a", [9], "cd")):
        cur.record(c)
    again = cur.resume(req)
    assert again.resumed_token_ids == [7, 8, 9] and again.params.prompt_logprobs is None
    assert again.params.max_tokens == 10 and again.prompt_token_ids == [1, 2]
    assert cur.trim(EngineChunk("r", "b", prompt_tokens=2)) is None  # the new ack
    assert cur.trim(_chunk("b", [7], "a")) is None  # a pure repeat
    got = cur.trim(_chunk("b", [8, 9, 10, 11], "bcdef"))
    assert got is not None
    (d,) = got.deltas
    assert (d.token_ids, d.text, d.logprobs, d.sampled_logprobs) == (
        [10, 11], "ef", [{10: -1.0}, {11: -1.0}], [-1.0, -1.0])
    cur.record(got)
    last = cur.trim(_chunk("b", [12], "g", finished=True))
    assert last is not None and last.finished and last.deltas[0].token_ids == [12]
    assert cur.samples[0].token_ids == [7, 8, 9, 10, 11]  # (recorded by the caller)
    assert cur.num_tokens == 5


def test_stream_cursor_splits_the_unfinished_samples_of_n_gt_1() -> None:
    req = EngineRequest("r", [1, 2], SamplingParams(n=3, seed=40, max_tokens=10,
                                                    prompt_logprobs=1), stream=True)
    cur = StreamCursor(3)
    cur.record(EngineChunk("r", "a", [SampleDelta(0, "ab", [7, 8]),
                                      SampleDelta(2, "x", [5], finish_reason="stop")]))
    cur.record(EngineChunk("r", "a", [SampleDelta(0, "c", [9])]))
    assert cur.num_tokens == 4
    parts = cur.split(req)
    assert [i for i, _, _ in parts] == [0, 1]  # sample 2 had finished
    (_, r0, c0), (_, r1, c1) = parts
    assert (r0.request_id, r0.resumed_token_ids, r0.params.seed, r0.params.n) == (
        "r-s0", [7, 8, 9], 40, 1)
    assert (r1.request_id, r1.resumed_token_ids, r1.params.seed) == ("r-s1", [], 41)
    assert r0.params.prompt_logprobs is None and r0.prompt_token_ids == [1, 2]
    got = c0.trim(_chunk("b", [7, 8, 9, 4], "abcd"))
    assert got is not None and got.deltas[0].token_ids == [4] and got.deltas[0].text == "d"
    assert c1.trim(EngineChunk("r-s1", "b")) is None  # its ack
    got = c1.trim(_chunk("b", [3], "q"))
    assert got is not None and got.deltas[0].token_ids == [3]


def test_each_sample_of_a_seeded_n3_request_resumes_alone(llm: LLM) -> None:
    """What ``StreamCursor.split`` asks of a replica: sample ``i`` of a seeded ``n=3``
    request, resumed as an ``n=1`` request with ``seed + i``, ends as it did."""
    params = SamplingParams(n=3, temperature=1.0, seed=17, max_tokens=24, ignore_eos=True)
    (whole,) = llm.generate([PROMPT], params)
    assert len({tuple(o.token_ids) for o in whole.outputs}) == 3
    for i, o in enumerate(whole.outputs):
        part, _ = _run(llm, params.for_child(i), o.token_ids[: 5 + i])
        assert part.token_ids == o.token_ids and part.text == o.text
    assert_pool_at_baseline(llm)


def test_stream_cursor_refuses_a_repeat_with_other_text() -> None:
    cur = StreamCursor()
    cur.record(_chunk("a", [7, 8], "abc"))
    cur.resume(EngineRequest("r", [1], SamplingParams()))
    with pytest.raises(RuntimeError, match="other text"):
        cur.trim(_chunk("b", [7, 8, 9], "abXd"))
