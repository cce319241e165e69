"""Suffix decoding in the scheduler: runs with its guesses give exactly the tokens of
runs without them (the simulated model reads every token back through the block
tables), guesses come from earlier responses as well as the request's own tokens,
and the response cache forgets what ended and is bounded."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from pagedserve.scheduler.spec_decode import SpeculativeConfig
from tests.scheduler.helpers import assert_baseline, make_scheduler, req, run_to_completion

SUFFIX = SpeculativeConfig.from_dict({"method": "suffix"})


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(1, 50) for _ in range(6)]
    return [base * 3 + [rng.randrange(1, 50) for _ in range(rng.randint(0, 9))]
            for _ in range(6)]


def _run(spec: SpeculativeConfig | None, prompts: list[list[int]], *, max_tokens: int = 24,
         n: int = 1, copy_period: int | None = 6, one_by_one: bool = False, **kw):
    """Every prompt, all at once or each after the last ended; returns the outputs,
    the draft counters, and the scheduler."""
    sched, sim = make_scheduler(speculative_config=spec, copy_period=copy_period, **kw)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_tokens=max_tokens, n=n, sched=sched))
        if one_by_one:
            out |= run_to_completion(sched, sim)
    out |= run_to_completion(sched, sim)
    sched.schedule()
    assert_baseline(sched)
    return out, sched.spec_stats, sched


def test_the_default_guesses_up_to_the_tree_depth() -> None:
    assert SUFFIX.num_speculative_tokens == SUFFIX.suffix_decoding_max_tree_depth == 24
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8
                             ).num_speculative_tokens == 8
    assert SpeculativeConfig().num_speculative_tokens == 4


@pytest.mark.parametrize("bad,field", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_min_token_prob": "high"}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_max_tree_depth": True}, "suffix_decoding_max_tree_depth"),
])
def test_bad_suffix_fields_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict({"method": "suffix", **bad})


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 7},  # guesses trimmed to the step's budget
    {"num_gpu_blocks": 14, "num_cpu_blocks": 40, "preemption_mode": "swap"},
    {"num_gpu_blocks": 14, "preemption_mode": "recompute"},
    {"n": 3},
    {"one_by_one": True},
    {"max_model_len": 40, "max_tokens": None},
])
def test_suffix_guesses_give_the_same_tokens(kw: dict) -> None:
    plain, _, _ = _run(None, _prompts(), **kw)
    spec, stats, _ = _run(SUFFIX, _prompts(), **kw)
    assert spec == plain
    assert stats["num_accepted_tokens"] > 0
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rejections ran too


def test_a_repeated_request_is_guessed_from_the_earlier_response() -> None:
    # No repetition inside any sequence (copy_period None): the n-gram search finds
    # nothing, but the second run of each prompt writes what the first one did.
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 900) for _ in range(12)] for _ in range(3)]
    twice = prompts + prompts
    plain, _, _ = _run(None, twice, copy_period=None, max_tokens=40, one_by_one=True)
    assert [plain[f"r{i}"] for i in range(3)] == [plain[f"r{i}"] for i in range(3, 6)]
    ngram, ngram_stats, _ = _run(SpeculativeConfig(), twice, copy_period=None, max_tokens=40,
                                 one_by_one=True)
    spec, stats, sched = _run(SUFFIX, twice, copy_period=None, max_tokens=40,
                              one_by_one=True)
    assert spec == ngram == plain
    assert ngram_stats["num_accepted_tokens"] <= 3
    # Each repeat accepts most of its 39 decoded tokens: its match starts one token
    # long (the tree holds responses, not prompts), so it guesses 1, 2, 4, ... tokens.
    assert stats["num_accepted_tokens"] >= 3 * 30
    assert stats["num_accepted_tokens"] / stats["num_draft_tokens"] > 0.9
    per_pos, drafted = stats["num_accepted_tokens_per_pos"], stats["num_draft_tokens_per_pos"]
    assert len(per_pos) == len(drafted) == 24 and sum(per_pos) == stats["num_accepted_tokens"]
    assert sum(drafted) == stats["num_draft_tokens"]
    assert all(a <= d for a, d in zip(per_pos, drafted))  # kept at a position: guessed there
    assert all(x >= y for x, y in pairwise(per_pos))  # a guess needs those before it
    proposer = sched.drafter.proposer  # type: ignore[union-attr]
    assert proposer._running == {}  # every ended request was let go
    assert proposer.cache.num_requests == 6 and proposer.cache.num_tokens == 6 * 40


def test_without_the_response_cache_only_own_tokens_are_searched() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 900) for _ in range(12)] for _ in range(2)]
    off = SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=0)
    _, stats, sched = _run(off, prompts + prompts, copy_period=None, max_tokens=30,
                           one_by_one=True)
    assert stats["num_accepted_tokens"] <= 3
    assert sched.drafter.proposer.cache.trees == []  # type: ignore[union-attr]
    _, stats, _ = _run(off, _prompts(), copy_period=6)
    assert stats["num_accepted_tokens"] > 0  # the request's own repeats still pay


def test_the_response_cache_keeps_at_most_its_limit() -> None:
    small = SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=4)
    _, _, sched = _run(small, _prompts() + _prompts(2), one_by_one=True)
    cache = sched.drafter.proposer.cache  # type: ignore[union-attr]
    assert 2 <= cache.num_requests <= 4 and len(cache.trees) <= 2


def test_aborted_and_waiting_requests_leave_nothing_behind() -> None:
    sched, sim = make_scheduler(speculative_config=SUFFIX, copy_period=6)
    for i, p in enumerate(_prompts()):
        sched.add_request(req(f"r{i}", p, max_tokens=30, sched=sched))
    for _ in range(4):
        sim.execute(plan := sched.schedule())
        sched.update_from_output(plan, sim.execute(plan))
    for i in range(6):
        sched.abort(f"r{i}")
    assert sched.drafter.proposer._running == {}  # type: ignore[union-attr]
    sched.schedule()
    assert_baseline(sched)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_plans_in_flight_with_suffix_guesses_give_the_tokens_of_one(mode: str) -> None:
    """Pipeline stages each on a plan: a row is guessed for only once its last step's
    tokens are back, and its response reaches the cache as they arrive."""
    from tests.scheduler.test_pipelined_plans import _add_all, run_pipelined

    ref_sched, ref_sim = make_scheduler(num_gpu_blocks=512, max_num_batched_tokens=512,
                                        copy_period=6)
    _add_all(ref_sched, max_tokens=30)
    reference = run_to_completion(ref_sched, ref_sim)
    sched, sim = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=64 if mode == "swap" else 0,
                                preemption_mode=mode, max_num_batched_tokens=24,
                                max_concurrent_batches=2, speculative_config=SUFFIX,
                                copy_period=6)
    _add_all(sched, max_tokens=30)
    outputs, overlapped = run_pipelined(sched, sim, depth=2)
    assert outputs == reference
    assert sched.spec_stats["num_accepted_tokens"] > 0 and len(overlapped) > 5
    assert not sched.in_flight
    assert_baseline(sched)
