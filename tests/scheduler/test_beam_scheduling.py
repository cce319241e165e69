"""Beam search in the scheduler, against the KV simulator: the beams equal a plain
re-implementation of the search over the same "model" (whose candidates depend on
every token read back through the block tables, so a wrong fork or copy-on-write
changes them), under pool pressure in both preemption modes too; forks share
blocks; held beams never step; an abort frees everything."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.beam import BeamHypothesis, BeamSearchParams, get_beam_search_score
from pagedserve.scheduler.outputs import ModelRunnerOutput, SampledToken
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.spec_decode import SpeculativeConfig
from tests.scheduler.helpers import assert_baseline, check_invariants, make_scheduler, req
from tests.scheduler.kv_sim import EOS, KVSim, distribution

PROMPTS = {"a": [5, 17, 99, 3, 42, 7], "b": list(range(8, 31)), "c": [300, 2, 301]}


def reference(prompt: list[int], p: BeamSearchParams, max_model_len: int
              ) -> list[tuple[list[int], float, str]]:
    """The search written out plainly: (generated tokens, cumulative logprob, reason)."""
    def score(tokens: list[int], cum: float) -> float:
        return get_beam_search_score(tokens, cum, [EOS], p.length_penalty)

    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float, str]] = []
    for _ in range(p.max_tokens):
        fresh = []
        for tokens, cum in live:
            for t, lp in distribution(tokens, 2 * p.beam_width).items():
                cand = ([*tokens, t], cum + lp)
                if t == EOS and not p.ignore_eos:
                    done.append((*cand, "stop"))
                elif len(cand[0]) >= max_model_len:
                    done.append((*cand, "length"))
                else:
                    fresh.append(cand)
        live = sorted(fresh, key=lambda c: score(*c), reverse=True)[:p.beam_width]
        if not live:
            break
    ranked = sorted(done + [(t, c, "length") for t, c in live],
                    key=lambda h: score(h[0], h[1]), reverse=True)[:p.beam_width]
    return [(t[len(prompt):], c, r) for t, c, r in ranked]


def add_beam(sched: Scheduler, rid: str, prompt: list[int], p: BeamSearchParams) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True,
                        logprobs=2 * p.beam_width)
    sched.add_request(sched.make_request(rid, prompt, sp, (EOS,), beam=p))


def run(sched: Scheduler, sim: KVSim, max_steps: int = 5000,
        width: int | None = None) -> dict[str, list[BeamHypothesis] | list[int]]:
    """Step to the end; a beam search's answer is its hypotheses, a plain request's its
    tokens. With ``width``, no group ever has more live beams than that."""
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return out
        plan = sched.schedule()
        rows = [sr for sr in plan.scheduled if sr.request_id in sched.requests
                and sched.requests[sr.request_id].beam is not None]
        for sr in rows:  # a held beam never computes
            r = sched.requests[sr.request_id]
            assert not r.beam.is_held(r)
        for u in sched.update_from_output(plan, sim.execute(plan)):
            if u.beams is not None:
                out[u.request_id] = u.beams
            else:
                out.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
        if width is not None:
            for r in sched.requests.values():
                if r.beam is not None:
                    assert len(r.beam.live) <= width
        check_invariants(sched, sim)
    raise AssertionError("scheduler did not finish")


def as_tuples(hyps: list[BeamHypothesis]) -> list[tuple[list[int], float, str]]:
    for h in hyps:
        chosen = [lp[t] for lp, t in zip(h.logprobs, h.token_ids, strict=True)]
        assert sum(chosen) == pytest.approx(h.cum_logprob)
    return [(h.token_ids, pytest.approx(h.cum_logprob), h.finish_reason) for h in hyps]


PARAMS = [BeamSearchParams(beam_width=4, max_tokens=10),
          BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True),
          BeamSearchParams(beam_width=2, max_tokens=9, length_penalty=0.0)]


@pytest.mark.parametrize(("block_size", "spec"), [(1, None), (4, None), (16, None),
                                                  (4, "ngram"), (4, "suffix")])
def test_beams_equal_the_plain_search(block_size: int, spec: str | None) -> None:
    """With n-gram or suffix drafting on, a plain request in the batch drafts; beams
    never do."""
    sched, sim = make_scheduler(
        num_gpu_blocks=512, block_size=block_size, copy_period=3 if spec else None,
        speculative_config=SpeculativeConfig(method=spec, num_speculative_tokens=3)
        if spec else None)
    for (rid, prompt), p in zip(PROMPTS.items(), PARAMS, strict=True):
        add_beam(sched, rid, prompt, p)
    sched.add_request(req("plain", [1, 2, 3, 4, 5] * 3, max_tokens=40, sched=sched))
    out = run(sched, sim, width=4)
    for (rid, prompt), p in zip(PROMPTS.items(), PARAMS, strict=True):
        assert as_tuples(out[rid]) == reference(prompt, p, 256)
    assert len(out["plain"]) == 40
    if spec:
        assert sched.spec_stats["num_accepted_tokens"] > 0
    assert any(h.finish_reason == "stop" for h in out["a"])  # EOS hypotheses occur
    assert_baseline(sched)


@pytest.mark.parametrize(("mode", "caching"), [("swap", True), ("recompute", True),
                                             ("recompute", False)])
def test_a_tiny_pool_changes_nothing(mode: str, caching: bool) -> None:
    """Too few blocks and seats for every beam at once: beams are preempted, held
    beams evicted, forks of non-resident parents recomputed (with no prefix cache to
    help, too); the answer is the same."""
    sched, sim = make_scheduler(num_gpu_blocks=14, block_size=4, num_cpu_blocks=64,
                                max_num_seqs=5, preemption_mode=mode,
                                enable_prefix_caching=caching)
    for (rid, prompt), p in zip(PROMPTS.items(), PARAMS, strict=True):
        add_beam(sched, rid, prompt, p)
    out = run(sched, sim)
    for (rid, prompt), p in zip(PROMPTS.items(), PARAMS, strict=True):
        assert as_tuples(out[rid]) == reference(prompt, p, 256)
    assert sum(sched.num_preemptions.values()) > 0
    assert_baseline(sched)


def test_a_long_prompt_is_prefilled_in_chunks_first() -> None:
    sched, sim = make_scheduler(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=32)
    prompt = [(7 * i) % 997 for i in range(150)]
    p = BeamSearchParams(beam_width=3, max_tokens=8)
    add_beam(sched, "long", prompt, p)
    out = run(sched, sim, width=3)
    assert as_tuples(out["long"]) == reference(prompt, p, 256)
    assert_baseline(sched)


def test_one_seat_per_beam_still_finishes() -> None:
    """A pool that holds one beam's blocks at a time: every round evicts held beams."""
    sched, sim = make_scheduler(num_gpu_blocks=4, block_size=4, max_num_seqs=2,
                                preemption_mode="recompute")
    p = BeamSearchParams(beam_width=3, max_tokens=5)
    add_beam(sched, "a", PROMPTS["a"], p)
    out = run(sched, sim)
    assert as_tuples(out["a"]) == reference(PROMPTS["a"], p, 256)
    assert sched.num_preemptions["recompute"] > 0
    assert_baseline(sched)


def test_forks_share_the_prompt_blocks() -> None:
    sched, sim = make_scheduler(num_gpu_blocks=64, block_size=4)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks and a partial one
    add_beam(sched, "a", prompt, BeamSearchParams(beam_width=4, max_tokens=6,
                                                   ignore_eos=True))
    plan = sched.schedule()
    sched.update_from_output(plan, sim.execute(plan))  # the prompt, then 4 beams
    assert len(sched.groups["a"]) == 4
    used = sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks
    assert used == 8  # all four share every block until they write
    plan = sched.schedule()
    assert len(plan.scheduled) == 4 and len(plan.blocks_to_copy) == 3  # three copy-on-writes
    assert sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks == 8 + 3
    sched.update_from_output(plan, sim.execute(plan))
    run(sched, sim)
    assert_baseline(sched)


def test_context_limit_and_abort() -> None:
    sched, sim = make_scheduler(num_gpu_blocks=64, block_size=4, max_model_len=9)
    p = BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True)
    add_beam(sched, "a", PROMPTS["a"], BeamSearchParams(beam_width=2, max_tokens=3,
                                                        ignore_eos=True))
    out = run(sched, sim)
    assert all(len(h.token_ids) == 3 and h.finish_reason == "length" for h in out["a"])
    assert as_tuples(out["a"]) == reference(PROMPTS["a"], p, 9)
    add_beam(sched, "b", PROMPTS["b"][:4], BeamSearchParams(beam_width=3, max_tokens=4))
    for _ in range(3):
        plan = sched.schedule()
        sched.update_from_output(plan, sim.execute(plan))
    assert len(sched.abort("b")) == 3
    assert_baseline(sched)


def scripted_step(sched: Scheduler, table: dict[tuple[int, ...], dict[int, float]]
                  ) -> list[BeamHypothesis] | None:
    """One step whose "model" is a table: generated-so-far -> next-token logprobs."""
    plan = sched.schedule()
    out = ModelRunnerOutput(plan.step_id)
    for sr in plan.scheduled:
        r = sched.requests[sr.request_id]
        dist = table[tuple(r.output_token_ids)]
        top = dict(sorted(dist.items(), key=lambda kv: -kv[1])[:2 * r.beam.params.beam_width])
        first = next(iter(top))
        out.sampled[sr.request_id] = SampledToken(first, top[first], top)
    for u in sched.update_from_output(plan, out):
        if u.beams is not None:
            return u.beams
    return None


def test_finished_hypotheses_and_length_penalty() -> None:
    # Step 1: 1 (-0.1) or 2 (-0.5). After 1, EOS is likely (-0.2); after 2 a long
    # confident continuation. With length_penalty 0 the short EOS answer wins on
    # total logprob; a large penalty favours the longer one.
    table = {
        (): {1: -0.1, 2: -0.5, 3: -5.0},
        (1,): {EOS: -0.2, 4: -3.0, 5: -4.0},
        (2,): {6: -0.05, EOS: -6.0, 7: -6.5},
        (1, 4): {EOS: -0.1, 8: -9.0, 7: -9.5}, (1, 5): {EOS: -0.1, 8: -9.0, 7: -9.5},
        (2, 6): {6: -0.05, EOS: -7.0, 8: -8.0}, (2, 7): {EOS: -0.1, 8: -9.0, 6: -9.5},
        (2, 6, 6): {EOS: -0.05, 8: -8.0, 7: -8.5},
        (1, 4, 8): {EOS: -1.0, 8: -1.0, 7: -1.0}, (1, 5, 8): {EOS: -1.0, 8: -1.0, 7: -1.0},
        (2, 6, 8): {EOS: -1.0, 8: -1.0, 7: -1.0}, (2, 7, 8): {EOS: -1.0, 8: -1.0, 7: -1.0},
    }
    for penalty, winner in ((0.0, [1, EOS]), (8.0, [2, 6, 6, EOS])):
        sched, _ = make_scheduler()
        add_beam(sched, "a", [0], BeamSearchParams(beam_width=2, max_tokens=4,
                                                   length_penalty=penalty))
        beams = None
        while beams is None:
            beams = scripted_step(sched, table)
            assert len(sched.groups.get("a", [])) <= 2  # never more live beams than the width
        assert beams[0].token_ids == winner and beams[0].finish_reason == "stop"
        assert_baseline(sched)


def test_beam_rows_must_ask_for_the_candidates() -> None:
    sched, _ = make_scheduler()
    with pytest.raises(ValueError, match="logprobs"):
        sched.make_request("a", [1, 2], SamplingParams(temperature=0.0, logprobs=2),
                           beam=BeamSearchParams(beam_width=2, max_tokens=3))
