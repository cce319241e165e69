"""LongRoPE's switch in the scheduler (``scheduler.long_rope``): a request longer than
the pre-trained length runs long from its first step; one that grows past it during
decode is recomputed once, long, from its first token; long blocks never serve a short
request's prefix (nor the reverse); drafts stop short of the switch."""

from __future__ import annotations

from pagedserve.scheduler.spec_decode import SpeculativeConfig
from tests.scheduler.helpers import (
    assert_baseline,
    check_invariants,
    make_scheduler,
    req,
    run_to_completion,
)

FROM = 16


def _steps(sched, sim, rid: str) -> list[tuple[int, int, bool]]:
    """(num_computed_tokens, tokens, long) of ``rid``'s row in each step to the end."""
    seen = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        seen += [(s.num_computed_tokens, len(s.token_ids), s.long_rope)
                 for s in plan.scheduled if s.request_id == rid]
        sched.update_from_output(plan, sim.execute(plan))
        check_invariants(sched, sim)
    return seen


def test_a_prompt_past_the_length_runs_long_from_its_first_step() -> None:
    sched, sim = make_scheduler(long_rope_from=FROM)
    sched.add_request(req("long", list(range(100, 120)), max_tokens=4, sched=sched))
    steps = _steps(sched, sim, "long")
    assert steps[0] == (0, 20, True) and all(long for *_, long in steps)
    assert_baseline(sched)


def test_growing_past_the_length_recomputes_once_long() -> None:
    """12 prompt tokens and 10 new: steps at 12-15 run short; the step that would
    compute position 16 instead prefills all 17 known tokens long, once."""
    sched, sim = make_scheduler(long_rope_from=FROM)
    sched.add_request(req("grow", list(range(100, 112)), max_tokens=10, sched=sched))
    steps = _steps(sched, sim, "grow")
    assert steps[:5] == [(0, 12, False), (12, 1, False), (13, 1, False), (14, 1, False),
                         (15, 1, False)]
    assert steps[5] == (0, 17, True)
    assert steps[6:] == [(17 + i, 1, True) for i in range(4)]
    assert sched.num_preemptions == {"swap": 0, "recompute": 0}  # not a preemption
    assert_baseline(sched)


def test_long_and_short_blocks_never_share() -> None:
    """The same 20 tokens as a long prompt, then the first 12 of them as a short one:
    the short prompt finds no cached prefix (those blocks hold long-rotated K/V); a
    second long prompt does."""
    sched, sim = make_scheduler(long_rope_from=FROM, block_size=4)
    prompt = list(range(200, 220))
    sched.add_request(req("a", prompt, max_tokens=1, sched=sched))
    run_to_completion(sched, sim)
    sched.add_request(req("short", prompt[:12], max_tokens=1, sched=sched))
    sched.add_request(req("b", prompt, max_tokens=1, sched=sched))
    plan = sched.schedule()
    rows = {s.request_id: s for s in plan.scheduled}
    assert rows["short"].num_computed_tokens == 0 and not rows["short"].long_rope
    assert rows["b"].num_computed_tokens == 16 and rows["b"].long_rope
    sched.update_from_output(plan, sim.execute(plan))
    run_to_completion(sched, sim)
    assert_baseline(sched)


def test_drafts_stop_short_of_the_switch() -> None:
    """n-gram drafts of 4 on a repeating sequence: no short row reaches past position
    15, so no guess is rotated by the factors it would not have had."""
    sched, sim = make_scheduler(long_rope_from=FROM, copy_period=2,
                                speculative_config=SpeculativeConfig(
                                    num_speculative_tokens=4, prompt_lookup_max=2))
    sched.add_request(req("d", [7, 8] * 5, max_tokens=20, sched=sched))
    steps = _steps(sched, sim, "d")
    assert any(n > 1 for c, n, long in steps if c and not long)  # drafts did run
    assert all(c + n <= FROM for c, n, long in steps if not long)
    assert any(long for *_, long in steps)
