"""Embedding (pooling) requests in the scheduler: they end after their prompt.

No row of theirs samples; "last" pooling marks only the prompt's final chunk,
"mean" every chunk (and never reads the prefix cache, which would skip
positions whose states it needs); the pool returns to baseline; a prompt may
fill the whole context since nothing is generated.
"""

from __future__ import annotations

import pytest

from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.helpers import assert_baseline, make_scheduler, req, step


def _pooling(sched, rid: str, prompt: list[int], kind: str = "last"):
    return sched.make_request(rid, prompt, SamplingParams(max_tokens=1),
                              pooling_params=PoolingParams(kind))


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_pooling_rows_never_sample_and_end_with_the_prompt(kind: str) -> None:
    sched, sim = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    prompt = list(range(10, 30))  # 20 tokens: chunks of 8, 8, 4
    sched.add_request(_pooling(sched, "e", prompt, kind))
    rows = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        (row,) = plan.scheduled
        rows.append((len(row.token_ids), row.sample_ids, row.pooling, row.pool_final))
        out = sim.execute(plan)
        out.pooled = {"e": ("part", len(rows))}
        (u,) = sched.update_from_output(plan, out)
        assert u.new_tokens == [] and u.pooled == ("part", len(rows))
        assert u.finished == row.pool_final
    marked = kind if kind == "mean" else None
    assert rows == [(8, [], marked, False), (8, [], marked, False), (4, [], kind, True)]
    assert "e" in sched.schedule().finished_ids
    assert_baseline(sched)


def test_mean_pooling_skips_the_prefix_cache_last_pooling_uses_it() -> None:
    sched, sim = make_scheduler()
    prompt = list(range(40, 57))  # 17 tokens: 4 full blocks of 4
    sched.add_request(req("g", prompt, max_tokens=2, sched=sched))
    while sched.has_unfinished_requests():
        step(sched, sim)
    sched.add_request(_pooling(sched, "mean", prompt, "mean"))
    (row,) = sched.schedule().scheduled
    assert row.num_computed_tokens == 0 and len(row.token_ids) == 17
    sched.abort("mean")
    sched.add_request(_pooling(sched, "last", prompt, "last"))
    (row,) = sched.schedule().scheduled
    assert row.num_computed_tokens == 16 and row.token_ids == prompt[16:]
    assert row.pooling == "last" and row.pool_final


def test_a_pooling_prompt_may_fill_the_context() -> None:
    sched, _ = make_scheduler(max_model_len=32)
    sched.add_request(_pooling(sched, "full", list(range(32))))
    with pytest.raises(ValueError, match="context"):
        sched.add_request(_pooling(sched, "over", list(range(33))))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(req("gen", list(range(32)), sched=sched))
