"""Disaggregated prefill across nodes: the prefill replica on one worker node, the decode
replica on the other, the K/V between them through the object stores of two raylets.

Its own module, so that the other modules' apps are gone and both worker nodes' CPUs
are free (each replica reserves a node's two).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.multinode.conftest import COMMON, MAX_TOKENS, PROMPTS, WORKER_CPUS, Nodes
from tests.serving.conftest import at_baseline, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Several 16-token blocks each, so there is something to ship ("Hello" is one token:
# eight of them would not fill a block).
LONG_PROMPTS = [" ".join([p] * 8) for p in PROMPTS if p != "Hello"][:4]


def test_prefill_and_decode_replicas_on_two_nodes_give_the_in_process_answers(
        nodes: Nodes, tiny_model: Path) -> None:
    from pagedserve.cluster import LLM, SamplingParams

    llm = LLM(model=str(tiny_model), num_gpu_blocks=64)
    try:
        ref = {p: o.outputs[0].text for p, o in zip(LONG_PROMPTS, llm.generate(
            LONG_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            use_tqdm=False))}
    finally:
        llm.shutdown()
    app = nodes.deploy("pdspread", {**COMMON, "model": str(tiny_model),
                                    "num_threads": WORKER_CPUS, "prefill_replicas": 1,
                                    "remote_prefill_min_tokens": 16})
    try:
        def stats() -> tuple[dict, dict]:
            body = httpx.get(f"{app.base}/v1/stats", timeout=60).json()
            return body["replicas"][0]["stats"], body["prefill_replicas"][0]["stats"]

        decode, prefill = stats()
        workers = {n.node_id for n in nodes.workers}
        assert {decode["node_id"], prefill["node_id"]} == workers  # one on each
        client = app.openai()
        for p in LONG_PROMPTS:
            out = client.completions.create(model="tiny-llama", prompt=p,
                                            max_tokens=MAX_TOKENS, temperature=0)
            assert out.choices[0].text == ref[p]
            n = out.usage.prompt_tokens
            assert out.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
        wait_for(lambda: all(at_baseline(s) for s in stats()), 30, "both pools at baseline")
        decode, prefill = stats()
        remote = decode["remote_prefill"]
        assert remote["remote_prefills"] == len(LONG_PROMPTS) and remote["failures"] == 0
        assert remote["received_bytes"] > 0
        assert prefill["kv_exported_blocks"] == decode["kv_imported_blocks"] > 0
    finally:
        nodes.delete("pdspread")
