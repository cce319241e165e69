"""Speculative decoding in the scheduler: the n-gram proposer, and runs with drafts
that must produce exactly the tokens of runs without them (the simulated model
reads every token back through the block tables, so a draft's stale KV, a block
hashed over a rejected guess or a wrong rollback changes the outputs)."""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputs
from pagedserve.scheduler.spec_decode import NgramProposer, SpeculativeConfig
from tests.scheduler.helpers import assert_baseline, make_scheduler, req, run_to_completion


def naive_propose(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition: the latest earlier occurrence of the longest suffix of lo..hi tokens."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_proposer_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                           prompt_lookup_max=3))
    r = Request("a", [1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3], SamplingParams())
    # "1 2 3" occurred at the start (followed by 9 9 2); "2 3" later, but shorter.
    assert prop.propose(r, 10) == (9, 9, 2)
    assert prop.propose(r, 2) == (9, 9)
    r.all_token_ids += [5]  # no earlier 5: nothing to propose
    assert prop.propose(r, 10) == ()
    r.all_token_ids += [4, 5]  # "5" occurred once, followed by 4
    assert prop.propose(r, 10) == (4, 5)


def test_proposer_equals_the_definition_on_random_sequences() -> None:
    # Byte-rich values make unaligned byte matches that are not token matches.
    values = [0, 1, 256, 65536, 16777216, 257, 65537]
    rng = random.Random(0)
    for trial in range(400):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo,
                                               prompt_lookup_max=hi))
        tokens = [rng.choice(values[: rng.randint(2, len(values))])
                  for _ in range(rng.randint(1, 40))]
        r = Request("a", tokens[:1], SamplingParams())
        for t in tokens[1:]:  # grown token by token, as a request is
            r.all_token_ids.append(t)
            assert list(prop.propose(r, k)) == naive_propose(r.all_token_ids, k, lo, hi), (
                trial, r)


@pytest.mark.parametrize("bad,field", [
    ({"method": "medusa"}, "method"),
    ({"method": "eagle"}, "speculative_config.model"),
    ({"method": "eagle3", "model": "x", "quantization": "int8"}, "quantization"),
    ({"method": "suffix", "model": "x"}, "speculative_config.model"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_lookahead": 2}, "unknown keys"),
])
def test_bad_config_names_the_field(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    base = [rng.randrange(1, 50) for _ in range(6)]
    return [base * 3 + [rng.randrange(1, 50) for _ in range(rng.randint(0, 9))]
            for _ in range(6)]


def _run(spec: SpeculativeConfig | None, *, n: int = 1, max_tokens: int = 24,
         **kw) -> tuple[dict[str, list[int]], dict[str, int]]:
    sched, sim = make_scheduler(speculative_config=spec, copy_period=6, **kw)
    for i, p in enumerate(_prompts()):
        sched.add_request(req(f"r{i}", p, max_tokens=max_tokens, n=n, sched=sched))
    out = run_to_completion(sched, sim)
    sched.schedule()
    assert_baseline(sched)
    return out, sched.spec_stats


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4)


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 7},  # drafts trimmed to the budget, chunked prompts
    {"num_gpu_blocks": 14, "num_cpu_blocks": 40, "preemption_mode": "swap"},
    {"num_gpu_blocks": 14, "preemption_mode": "recompute"},
    {"n": 3},
    {"enable_prefix_caching": False},
])
def test_drafts_give_the_same_tokens(kw: dict) -> None:
    plain, _ = _run(None, **kw)
    spec, stats = _run(SPEC, **kw)
    assert spec == plain
    assert stats["num_accepted_tokens"] > 0
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rejections ran too


def test_drafts_never_pass_max_tokens_or_the_model_length() -> None:
    for max_tokens in (1, 2, 5):
        out, _ = _run(SPEC, max_tokens=max_tokens)
        assert all(len(t) == max_tokens for t in out.values())
    out, stats = _run(SPEC, max_tokens=None, max_model_len=40)  # type: ignore[arg-type]
    lens = {len(p) for p in _prompts()}
    assert sorted(len(t) for t in out.values()) == sorted(40 - n for n in
                                                          [len(p) for p in _prompts()])
    assert lens and stats["num_drafts"] > 0


def test_a_stop_token_inside_accepted_drafts_ends_the_sequence_there() -> None:
    sched, sim = make_scheduler(speculative_config=SPEC, copy_period=6)
    prompt = _prompts()[0]
    plain, _ = _run(None, max_tokens=24)
    stop_at = plain["r0"][10]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at])
    sched.add_request(sched.make_request("r0", prompt, params))
    out = run_to_completion(sched, sim)
    assert out["r0"] == plain["r0"][: plain["r0"].index(stop_at) + 1]
    sched.schedule()
    assert_baseline(sched)


def test_constrained_requests_get_drafts_and_wide_batches_none() -> None:
    sched, sim = make_scheduler(speculative_config=SPEC, copy_period=6)
    params = SamplingParams(max_tokens=12, temperature=0.0,
                            structured_outputs=StructuredOutputs(regex="[a-z]+"))
    sched.add_request(sched.make_request("g", _prompts()[0], params))
    run_to_completion(sched, sim)
    assert sched.spec_stats["num_drafts"] > 0  # the sampler masks each guessed position

    wide = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=3)
    _, stats = _run(wide)  # six running sequences: never below the limit
    assert stats["num_drafts"] == 0
    _, stats = _run(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=7))
    assert stats["num_drafts"] > 0


def test_a_short_pool_drops_the_drafts_before_preempting_anyone() -> None:
    # Two sequences that fit exactly in the pool with one token per step.
    prompt = [3, 4, 5, 6] * 2
    outs = []
    for spec in (None, SPEC):
        sched, sim = make_scheduler(num_gpu_blocks=6, block_size=4, speculative_config=spec,
                                    copy_period=4)
        for i in range(2):
            sched.add_request(req(f"r{i}", [*prompt, i], max_tokens=3, sched=sched))
        outs.append(run_to_completion(sched, sim))
        # Four guesses after the 9-token prompts would need a seventh block.
        assert sched.num_preemptions == {"swap": 0, "recompute": 0}
    assert outs[0] == outs[1]


def test_a_last_prompt_chunk_of_one_token_with_siblings_to_fork_gets_no_drafts() -> None:
    """The row that ends an n > 1 prompt samples for every sibling and forks them."""
    prompt = [5, 6, 7, 8] * 2 + [5, 6]  # "5 6" occurred before: the lookup would guess
    outs = []
    for spec in (None, SPEC):
        sched, sim = make_scheduler(max_num_batched_tokens=9, speculative_config=spec,
                                    copy_period=4)
        sched.add_request(req("r", prompt, max_tokens=6, n=3, sched=sched))
        outs.append(run_to_completion(sched, sim))
        sched.schedule()
        assert_baseline(sched)
    assert outs[0] == outs[1] and len(outs[1]) == 3
