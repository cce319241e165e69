"""Random batches of requests, valid and not, through one engine under memory pressure.

Each example adds a few requests with random sampling settings (penalties,
``logit_bias``, ``min_tokens``, stop ids, bad words, seeds, logprobs, ``n``), some with
out-of-range values or token ids, each with a random LoRA adapter (or none; at
most one adapter runs at a time) and priority, may abort one mid-generation, and
runs the engine dry; about two requests in seven are embeddings (last or mean
pooling) and one in seven a beam search (width 2 or 3) instead. A bad setting must fail as a ``ValueError`` that names its field
before anything is queued; every other request must finish within its limits
(with and without speculative decoding);
and after each example the pool must be back at baseline, so nothing leaks
across the examples that share the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedserve.cluster import LLM, BeamSearchParams, LoRARequest, PoolingParams, SamplingParams
from pagedserve.cluster.beam_search import get_beam_search_score
from pagedserve.scheduler.sampling_params import StructuredOutputs
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

VOCAB = 49152  # the tiny checkpoints' vocabulary (SmolLM2's tokenizer)
DIGITS = "[0-9]{2,5}"
MAX_LEN = 512  # their max_position_embeddings


@pytest.fixture(scope="module")
def loras(llama_loras: dict[str, LoRARequest]) -> list[LoRARequest | None]:
    return [None, *llama_loras.values()]


@pytest.fixture(scope="module", params=["swap", "recompute", "swap+ngram", "recompute+ngram"])
def llm(request: pytest.FixtureRequest, tiny_llama_dir: str) -> Iterator[LLM]:
    """A pool of 8 blocks (128 tokens) for up to 4 sequences: preemption happens.
    ``+ngram``: with speculative decoding (drafted rows, rejected guesses' slots).
    LoRA adapters, one at a time (the cap skips waiting requests); the recompute
    engines run the priority policy, the swap ones FCFS (where a priority is an error).
    The recompute engine with drafts also offloads evicted prefixes to 12 CPU blocks."""
    mode, _, spec = request.param.partition("+")
    engine = LLM(model=tiny_llama_dir, num_gpu_blocks=8, preemption_mode=mode,
                 num_cpu_blocks=6 if mode == "swap" else 0,
                 num_offload_blocks=12 if mode == "recompute" and spec else 0,
                 max_num_batched_tokens=32, max_num_seqs=4,
                 speculative_config={"method": spec, "num_speculative_tokens": 3}
                 if spec else None, enable_lora=True, max_loras=1, max_lora_rank=8,
                 scheduling_policy="priority" if mode == "recompute" else "fcfs")
    yield engine
    engine.shutdown()


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


def _mostly(valid: list[Any], bad: Any) -> st.SearchStrategy[Any]:
    """One of ``valid``, or (about one time in eight) the out-of-range ``bad``."""
    return st.sampled_from([*(valid * 7)[:7], bad])


SETTINGS = st.fixed_dictionaries({}, optional={
    "n": _mostly([1, 2, 3], 0),
    "temperature": _mostly([0.0, 0.7, 1.0], -1.0),
    "top_p": _mostly([1.0, 0.5], 0.0),
    "top_k": _mostly([-1, 1, 5], 0),
    "min_p": _mostly([0.0, 0.1, 1.0], 1.5),
    "allowed_token_ids": _mostly([None, [5, 42], [2, 300]], [VOCAB]),
    "truncate_prompt_tokens": _mostly([None, 5, 40], 0),
    "structured_outputs": _mostly([None, None, StructuredOutputs(regex=DIGITS),
                                   StructuredOutputs(choice=("yes", "no"))],
                                  StructuredOutputs(regex="(unclosed")),
    "seed": _mostly([None, 0, 7, 2**31], -1),
    "min_tokens": st.integers(0, 6),
    "stop_token_ids": st.lists(_mostly([2, 7, 300], VOCAB + 5), max_size=2),
    "bad_words_token_ids": _mostly([None, [[42]], [[5, 42], [300]]], [[]]),
    "logprobs": _mostly([None, 0, 3], 50),
    "presence_penalty": _mostly([0.0, 1.5, -0.5], 2.5),
    "frequency_penalty": _mostly([0.0, 0.7, -2.0], 3.0),
    "repetition_penalty": _mostly([1.0, 1.3, 0.8], 0.0),
    "logit_bias": st.dictionaries(_mostly([5, 42, 300], VOCAB), _mostly([-100.0, 3.0, 100.0],
                                                                           250.0), max_size=2),
})
REQUEST = st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60) | st.just([VOCAB + 1]),
    st.integers(1, 40),
    SETTINGS,
    st.integers(0, 3),  # the adapter: none or one of three
    st.sampled_from([0, 0, 1, 2]),  # the priority
    # an embedding request or a beam search instead
    st.sampled_from([None, None, None, None, "last", "mean", "beam2", "beam3"]),
)


def _named_field(message: str, fields: set[str]) -> bool:
    return any(message.startswith(f) or f" {f}" in message for f in fields)


HEAVY = [  # more than the pool holds: forces preemption with penalties and forks in flight
    (list(range(100, 160)), 40, {"presence_penalty": 1.0, "repetition_penalty": 1.3}, 0, 0,
     None),
    (list(range(200, 250)), 40, {"n": 2, "temperature": 1.0, "seed": 3,
                                 "frequency_penalty": 0.5}, 1, 0, None),
    (list(range(300, 340)), 40, {}, 2, 0, None),
    (list(range(400, 455)), 30, {"logit_bias": {42: 3.0}, "min_tokens": 5}, 1, 0, None),
    (list(range(500, 570)), 1, {}, 0, 0, "mean"),
    (list(range(600, 630)), 30, {}, 2, 0, "beam3"),
    # Biased towards 42, then 5: both bans must bite (42 always, 5 right after a 5).
    (list(range(700, 720)), 12, {"logit_bias": {42: 100.0, 5: 90.0},
                                 "bad_words_token_ids": [[42], [5, 5]]}, 0, 0, None),
]


@example(requests=HEAVY, abort_at=None)
@example(requests=HEAVY, abort_at=12)
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(REQUEST, min_size=1, max_size=6), abort_at=_maybe(st.integers(0, 30)))
def test_random_requests_finish_or_fail_cleanly(llm: LLM, loras, requests, abort_at) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    try:
        _run_example(llm, loras, requests, abort_at)
    finally:  # a failing example must not leave requests behind for the next one
        for rid in list(engine._groups):
            engine.abort_request(rid)


def _run_example(llm: LLM, loras, requests, abort_at) -> None:
    engine = llm.engine
    added: dict[str, tuple[SamplingParams, int]] = {}
    fcfs = engine.config.scheduling_policy == "fcfs"
    for i, (prompt, max_tokens, kw, lora, priority, pooling) in enumerate(requests):
        try:
            params = SamplingParams(max_tokens=max_tokens, **kw)
        except ValueError as e:
            assert _named_field(str(e), set(kw)), e
            continue
        beam = None
        if pooling is not None and pooling.startswith("beam"):
            beam = BeamSearchParams(beam_width=int(pooling[-1]), max_tokens=max_tokens,
                                    ignore_eos=bool(kw.get("seed")))
        try:
            if beam is not None:
                rid = engine.add_request(prompt, None, request_id=f"fuzz-{i}",
                                         lora_request=loras[lora], priority=priority,
                                         beam=beam)
            else:
                rid = engine.add_request(
                    prompt, params, request_id=f"fuzz-{i}", lora_request=loras[lora],
                    priority=priority, pooling_params=PoolingParams(pooling) if pooling else None)
        except ValueError as e:
            if fcfs and priority and "scheduling_policy" in str(e):
                continue
            assert _named_field(str(e), {"stop_token_ids", "logit_bias", "allowed_token_ids",
                                         "structured_outputs", "prompt", "n",
                                         "bad_words_token_ids"}), e
            continue
        assert not (fcfs and priority), "a priority under FCFS must be refused"
        if beam is not None:
            added[rid] = (beam, len(prompt), "beam")
            continue
        added[rid] = (params, min(len(prompt), params.truncate_prompt_tokens or len(prompt)),
                      pooling)
    aborted: set[str] = set()
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        running = sorted(set(added) - set(finished))
        if steps == abort_at and running:
            assert engine.abort_request(running[0])
            aborted.add(running[0])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 500, "the engine stopped making progress"
    assert set(finished) == set(added) - aborted
    for rid, out in finished.items():
        params, prompt_len, pooling = added[rid]
        assert len(out.prompt_token_ids) == prompt_len
        if pooling == "beam":
            _check_beams(engine, params, out)
            continue
        if pooling is not None:  # an embedding: no tokens, a unit vector of the hidden size
            (sample,) = out.outputs
            assert sample.token_ids == [] and sample.finish_reason == "stop"
            assert out.embedding is not None
            assert len(out.embedding) == engine.model_info["hidden_size"]
            assert abs(sum(x * x for x in out.embedding) - 1.0) < 1e-4
            continue
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            n_out = len(sample.token_ids)
            assert sample.finish_reason in ("stop", "length"), sample
            assert n_out <= params.max_tokens
            if sample.finish_reason == "length":
                assert n_out == params.max_tokens
            stops = set(params.stop_token_ids) | set(engine.eos_token_ids)
            # Allowed ids that all stop (or that one-token bad words leave only stops) win
            # over min_tokens: nothing else may be sampled.
            banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
            only_stops = params.allowed_token_ids and (
                set(params.allowed_token_ids) - banned <= stops)
            if (params.min_tokens and sample.finish_reason == "stop" and not only_stops
                    and params.structured_outputs is None):
                # (allowed ids that all stop win over it, and so does a complete grammar)
                assert n_out >= params.min_tokens
            if params.allowed_token_ids and params.structured_outputs is None:
                # (with a grammar that allows none of them, the grammar wins)
                assert set(sample.token_ids) <= set(params.allowed_token_ids)
            if (params.bad_words_token_ids and not params.allowed_token_ids
                    and params.structured_outputs is None):
                # (allowed ids that are all banned win, and so does a grammar)
                toks = sample.token_ids
                for word in params.bad_words_token_ids:
                    assert not any(toks[k:k + len(word)] == word
                                   for k in range(len(toks) - len(word) + 1)), (word, toks)
            spec = params.structured_outputs
            if spec is not None and not params.allowed_token_ids and not params.stop_token_ids:
                text = sample.text  # a prefix of a valid output, whole when it stopped
                if spec.regex is not None:
                    assert re.fullmatch(r"[0-9]{0,5}", text), text
                    assert sample.finish_reason == "length" or len(text) >= 2, text
                else:
                    assert any(c.startswith(text) for c in spec.choice), text
            if params.logprobs is not None:
                assert sample.logprobs is not None and len(sample.logprobs) == n_out
            assert all(0 <= t < VOCAB for t in sample.token_ids)
    assert_pool_at_baseline(llm)


def _check_beams(engine: Any, params: BeamSearchParams, out: Any) -> None:
    """A beam search's answer: ``beam_width`` hypotheses, best first, each within its
    limits (EOS ends one only when not ignored)."""
    assert len(out.outputs) == params.beam_width
    scores = []
    for c in out.outputs:
        assert c.finish_reason in ("stop", "length")
        assert 1 <= len(c.token_ids) <= params.max_tokens
        if c.finish_reason == "stop":
            assert not params.ignore_eos and c.token_ids[-1] in engine.eos_token_ids
        assert len(c.logprobs) == len(c.token_ids)
        scores.append(get_beam_search_score(out.prompt_token_ids + c.token_ids,
                                            c.cumulative_logprob, engine.eos_token_ids))
    assert scores == sorted(scores, reverse=True)
