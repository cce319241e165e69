"""Output kinds (vLLM's ``RequestOutputKind``) through the real engine."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


def test_output_kinds_give_what_a_cumulative_stream_ends_with(tiny_llama_dir) -> None:
    """``output_kind``: ``"final_only"`` (what ``LLM.generate`` asks for) answers once,
    finished; ``"delta"`` (what an engine replica streams) outputs, concatenated, are
    the cumulative stream's last output, through ``DeltaTracker`` too (n = 2, a stop
    string that ends one sample early, logprobs). An unknown kind is a ValueError."""
    from pagedserve.cluster.wire import DeltaTracker

    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, logprobs=2,
                                stop=["Exercise"], ignore_eos=True)
        eng = llm.engine
        kinds = ("cumulative", "delta", "final_only")
        rids = {eng.add_request([5, 6, 7], params, output_kind=k): k for k in kinds}
        seen: dict[str, list] = {k: [] for k in kinds}
        while eng.has_unfinished_requests():
            for out in eng.step():
                seen[rids[out.request_id]].append(out)
        last = seen["cumulative"][-1]
        assert sorted(o.finish_reason for o in last.outputs) == ["length", "stop"]
        assert len(seen["final_only"]) == 1 and seen["final_only"][0].finished

        def fields(outs) -> list[tuple]:
            return [(o.text, o.token_ids, o.logprobs, o.finish_reason, o.stop_reason)
                    for o in outs]

        assert fields(seen["final_only"][0].outputs) == fields(last.outputs)
        deltas = seen["delta"]
        assert len(deltas) == len(seen["cumulative"]) and all(d.delta for d in deltas)
        joined = [(
            "".join(d.outputs[i].text for d in deltas),
            [t for d in deltas for t in d.outputs[i].token_ids],
            [lp for d in deltas for lp in d.outputs[i].logprobs],
            deltas[-1].outputs[i].finish_reason, deltas[-1].outputs[i].stop_reason,
        ) for i in range(2)]
        assert joined == fields(last.outputs)
        streamed, tracked = DeltaTracker(2), DeltaTracker(2)
        assert ([streamed.deltas(o) for o in seen["cumulative"]]
                == [tracked.deltas(o) for o in deltas])
        with pytest.raises(ValueError, match="output_kind"):
            eng.add_request([5, 6, 7], params, output_kind="deltas")
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
