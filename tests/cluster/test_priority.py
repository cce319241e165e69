"""The priority policy through the engine: the most urgent waiting request runs first,
tokens equal Hugging Face's whatever the order, and bad uses are ``ValueError``s."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_one_seat_goes_to_the_most_urgent_request(tiny_llama_dir) -> None:
    prompts = prompts_of_mixed_lengths(4)
    priorities = [2, 0, 3, 1]
    llm = LLM(model=tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1,
              num_gpu_blocks=64)
    try:
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY, priority=prio)
               for p, prio in zip(prompts, priorities)]
        finished, tokens = [], {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append(out.request_id)
                    tokens[out.request_id] = out.outputs[0].token_ids
        assert finished == [ids[i] for i in (1, 3, 0, 2)]
        assert [tokens[i] for i in ids] == hf_greedy(tiny_llama_dir, prompts, 8)
        outs = llm.generate(prompts, GREEDY, priority=priorities)  # the offline API too
        assert [o.outputs[0].token_ids for o in outs] == [tokens[i] for i in ids]
        with pytest.raises(ValueError, match="priority"):
            llm.generate(prompts, GREEDY, priority=[0])
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.add_request(prompts[0], GREEDY, priority=0.5)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_priority_needs_the_priority_policy(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=16)
    try:
        with pytest.raises(ValueError, match="scheduling_policy"):
            llm.generate([[5, 6, 7]], GREEDY, priority=[1])
        assert len(llm.generate([[5, 6, 7]], GREEDY, priority=[0])[0].outputs[0].token_ids) == 8
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(model=tiny_llama_dir, scheduling_policy="lifo")


@pytest.mark.parametrize("aging_s, first", [(None, "urgent"), (0.001, "older")])
def test_aging_lets_an_older_request_go_before_a_fresher_urgent_one(
        tiny_llama_dir, aging_s: float | None, first: str) -> None:
    """One seat. A priority-3 request, then 50 ms later a priority-0 one: strict
    priorities run the urgent one first; aged by 1 ms a level, the older one has
    gained ~50 levels by then and runs first."""
    import time

    llm = LLM(model=tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1,
              num_gpu_blocks=64, priority_aging_s=aging_s)
    try:
        engine = llm.engine
        assert engine.scheduler.aging_s == aging_s
        names = {engine.add_request([5, 6, 7], GREEDY, priority=3): "older"}
        time.sleep(0.05)  # the waiting time aging counts
        names[engine.add_request([8, 9, 10], GREEDY, priority=0)] = "urgent"
        finished = []
        while engine.has_unfinished_requests():
            finished += [names[o.request_id] for o in engine.step() if o.finished]
        assert finished[0] == first
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
