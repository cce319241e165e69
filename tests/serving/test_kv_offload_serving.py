"""KV offloading behind Serve: ``kv_offloading_size`` in the app's args gives the
replica a CPU prefix tier; chats visited in turn through a pool too small for
them come back as CPU hits, with the answers of an uncached offline engine, and
``/v1/stats`` and ``/metrics`` count what was loaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.cluster import LLM, SamplingParams
from tests.serving.conftest import App, Cluster

pytestmark = [pytest.mark.ray]

TOPICS = ["the history of paged memory in operating systems",
          "how a scheduler shares blocks between requests",
          "why attention reads every cached key of a sequence"]


@pytest.fixture(scope="module")
def offload_app(cluster: Cluster, tiny_model: Path) -> Iterator[App]:
    # 14 blocks of 16 tokens hold one conversation's turn (127-206 tokens with the
    # answer), so the next conversation evicts it; 1 MiB holds 128 of the tiny
    # model's 8 KiB blocks.
    app = cluster.deploy("offload", {"model": str(tiny_model), "num_gpu_blocks": 14,
                                     "max_model_len": 512, "num_threads": 1,
                                     "kv_offloading_size": 2**-10})
    yield app
    cluster.delete("offload")


def system_prompt(topic: str) -> str:
    return " ".join(f"Paragraph {i} is about {topic}." for i in range(8))


def test_chats_revisited_through_a_small_pool_load_their_prefix_from_cpu(
        offload_app: App, tiny_model: Path) -> None:
    client = offload_app.openai()
    chats = [[{"role": "system", "content": system_prompt(t)}] for t in TOPICS]
    got: list[str] = []
    for turn in range(3):
        for chat in chats:
            chat.append({"role": "user", "content": f"Question {turn}: tell me more."})
            out = client.chat.completions.create(model="tiny-llama", messages=chat,
                                                 max_tokens=8, temperature=0.0)
            text = out.choices[0].message.content
            got.append(text)
            chat.append({"role": "assistant", "content": text})
    llm = LLM(model=str(tiny_model), num_gpu_blocks=256, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        want = [llm.chat(chat[:2 * turn + 2], params)[0].outputs[0].text
                for turn in range(3) for chat in chats]
    finally:
        llm.shutdown()
    assert got == want
    (stats,) = offload_app.wait_baseline().values()
    off = stats["kv_offload"]
    assert off["enabled"] and off["offloaded_blocks"] > 0
    assert off["cpu_hit_tokens"] >= 6 * 4 * 16  # six later turns, 4+ blocks each
    assert stats["memory"]["num_cpu_cached_blocks"] > 0
    metrics = httpx.get(f"{offload_app.base}/metrics", timeout=60).text
    line = next(x for x in metrics.splitlines()
                if x.startswith("pagedserve_prefix_cache_cpu_hits_total{"))
    assert float(line.rsplit(" ", 1)[1]) == off["cpu_hit_tokens"]
