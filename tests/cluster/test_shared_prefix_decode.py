"""Decode steps whose requests share a cached prompt split it off (``kernels.cpu_cascade``)
and give the tokens of an engine that reads every row's whole context, and of
Hugging Face, in pure decode steps and beside a chunked prefill; batch-invariant
engines never split."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.kernels import available_backends, cpu_cascade
from pagedserve.kernels.cpu_backend import CpuNativeBackend
from tests.cluster.conftest import hf_greedy

pytestmark = pytest.mark.skipif(
    "cpu" not in available_backends("cpu"), reason="no C compiler for the native kernel"
)
SYSTEM = [(i * 41 + 7) % 20000 + 100 for i in range(330)]  # 20 full blocks of 16, shared
TAILS = [[(i * 13 + k * 977) % 20000 + 100 for i in range(5 + 3 * k)] for k in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def split_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many rows each split decode call took."""
    calls: list[int] = []
    real = cpu_cascade.shared_prefix_decode

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(cpu_cascade, "shared_prefix_decode", counting)
    yield calls


def generate(model: str, stats: dict | None = None, **kwargs) -> list[list[int]]:
    """The four requests' greedy tokens after the system prompt is cached; the
    engine's stats go into ``stats`` when given."""
    llm = LLM(model=model, num_gpu_blocks=256, **kwargs)
    try:
        llm.generate([{"prompt_token_ids": SYSTEM}], SamplingParams(max_tokens=1),
                     use_tqdm=False)  # the system prompt now sits in the prefix cache
        outs = llm.generate([{"prompt_token_ids": SYSTEM + t} for t in TAILS], GREEDY,
                            use_tqdm=False)
        if stats is not None:
            stats.update(llm.engine.get_stats())
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_requests_after_one_system_prompt_decode_through_the_split(
        default_model_dir: str, split_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    stats: dict = {}
    split = generate(default_model_dir, stats)
    assert split_calls and max(split_calls) == 4  # the four requests' decode steps
    assert split == hf_greedy(default_model_dir, [SYSTEM + t for t in TAILS], 12)
    # The stats count each split step once (not per layer): its rows, and the 320
    # shared keys each row but the first of its run did not read again.
    layers = 30  # SmolLM2-135M
    steps, rows = stats["shared_prefix_steps"], stats["shared_prefix_rows"]
    assert steps == len(split_calls) // layers and rows == sum(split_calls) // layers
    assert steps >= 11 and stats["shared_prefix_keys_saved"] == 320 * (rows - steps)
    split_calls.clear()
    monkeypatch.setattr(cpu_cascade, "MIN_PREFIX_TOKENS", 10**9)
    assert generate(default_model_dir, stats) == split
    assert split_calls == []
    assert stats["shared_prefix_steps"] == stats["shared_prefix_rows"] == 0


def test_decode_rows_beside_a_chunked_prefill_split_too(
        default_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fifth, unrelated 600-token prompt prefills in 64-token chunks while the four
    # decode: those steps are mixed, and their decode rows still split.
    mixed: list[int] = []
    real = CpuNativeBackend._split_decode_rows

    def counting(self, *args, **kwargs):
        split = real(self, *args, **kwargs)
        if split is not None:
            mixed.append(len(split[0]))
        return split

    monkeypatch.setattr(CpuNativeBackend, "_split_decode_rows", counting)
    other = [(i * 29 + 3) % 20000 + 100 for i in range(600)]
    prompts = [SYSTEM + t for t in TAILS] + [other]
    llm = LLM(model=default_model_dir, num_gpu_blocks=256, max_num_batched_tokens=64)
    try:
        llm.generate([{"prompt_token_ids": SYSTEM}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert mixed and max(mixed) == 4
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(default_model_dir, prompts, 12)


def test_batch_invariant_engines_do_not_split(default_model_dir: str,
                                              split_calls: list[int]) -> None:
    generate(default_model_dir, batch_invariant=True)
    assert split_calls == []
