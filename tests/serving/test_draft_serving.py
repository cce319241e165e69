"""Draft-model speculative decoding served over HTTP: a random Llama (SmolLM2's tokenizer
and chat template) in an engine replica with two TP ranks (Ray actors, gloo), where only
rank 0 holds the draft (an int8 copy of the target), against the in-process engine
without drafts on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.testing import write_random_checkpoint
from tests.serving.conftest import App, Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_random_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama",
                                        "llama", resolve_model(None).path,
                                        max_position_embeddings=2048))


@pytest.fixture(scope="module")
def draft_app(cluster: Cluster, llama_dir: Path) -> Iterator[App]:
    spec = {"model": str(llama_dir), "num_speculative_tokens": 3, "quantization": "int8"}
    app = cluster.deploy("draft", {"model": str(llama_dir), "served_model_name": "tiny",
                                   "tensor_parallel_size": 2, "num_gpu_blocks": 64,
                                   "num_threads": 1, "speculative_config": spec})
    yield app
    cluster.delete("draft")


def test_draft_model_over_http_equals_plain_decoding(draft_app: App, llama_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client = draft_app.openai()
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0.0,
          "extra_body": {"ignore_eos": True}}
    out = client.chat.completions.create(**kw)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    llm = LLM(model=str(llama_dir), num_gpu_blocks=64)
    try:
        ref = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=24,
                                                ignore_eos=True))[0].outputs[0]
    finally:
        llm.shutdown()
    assert out.usage.completion_tokens == 24 and ref.text
    assert out.choices[0].message.content == ref.text == streamed
    text = httpx.get(f"{draft_app.base}/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    accepted = [s.value for s in fams["pagedserve_spec_decode_num_accepted_tokens"].samples]
    assert accepted and accepted[0] > 24  # an int8 copy guesses its target's tokens
    (stats,) = draft_app.wait_baseline().values()
    assert stats["spec_decode"]["num_drafts"] > 0
