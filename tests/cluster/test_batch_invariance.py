"""Batch-invariant mode (``batch_invariant=True``, ``worker.batch_invariant``): a
request's tokens and logprobs, bit for bit, do not depend on the rest of the batch.

One probe request (a 300-token prompt, longer than the native kernel's prefill
cut-off, set to 192 keys here, so the default mode would run its prefill on SDPA)
is run alone on an
engine that prefills whole prompts, and compared exactly (``==`` on floats) with the
same probe run: among staggered requests of other lengths on an engine that chunks
prompts into 64-token steps; after a request sharing its first 200 tokens (a prefix
hit); in pools so small that it is preempted (recompute and swap); resumed from its
own first tokens among others; with n-gram speculative decoding; in bf16, int8 and
int4 (each against its own run alone); under a LoRA adapter among others. Greedy
with top-3 logprobs and seeded sampling at temperature 1 both. Settings the mode does not cover are ``ValueError``s naming ``batch_invariant``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.engine import LLMEngine
from pagedserve.cluster.outputs import CompletionOutput
from pagedserve.kernels import cpu_backend
from pagedserve.worker.testing import write_random_checkpoint

PROBE = [(i * 37 + 11) % 20000 + 100 for i in range(300)]
OTHERS = [[(i * 53 + k * 101) % 20000 + 100 for i in range(n)]
          for k, n in enumerate((9, 140, 33, 257, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24,
                        ignore_eos=True, logprobs=1)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}

Schedule = list[tuple[int, str, list[int], SamplingParams, dict[str, Any]]]


def run(engine: LLMEngine, schedule: Schedule) -> dict[str, CompletionOutput]:
    """Add each request at its step (0 = before the first), step to the end."""
    pending = sorted(schedule, key=lambda item: item[0])
    names: dict[str, str] = {}
    done: dict[str, CompletionOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, name, prompt, params, kwargs = pending.pop(0)
            names[engine.add_request(prompt, params, **kwargs)] = name
        for out in engine.step():
            if out.finished:
                done[names[out.request_id]] = out.outputs[0]
        step += 1
    return done


def crowd(params: SamplingParams) -> Schedule:
    """The probe among five others, arriving over the first steps."""
    others = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    return [(0, "o0", OTHERS[0], others, {}), (0, "o1", OTHERS[1], others, {}),
            (1, "probe", PROBE, params, {}), (2, "o2", OTHERS[2], others, {}),
            (4, "o3", OTHERS[3], others, {}), (7, "o4", OTHERS[4], others, {})]


def assert_same(got: CompletionOutput, want: CompletionOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs  # dicts of floats: exact equality


@contextlib.contextmanager
def engine(model: str, **kwargs: Any) -> Iterator[LLM]:
    """A batch-invariant engine, shut down whatever the block raised."""
    llm = LLM(model=model, batch_invariant=True, **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", autouse=True)
def short_native_cutoff() -> Iterator[None]:
    """The default mode's native-rows cut-off (2,048 keys) below the probe's length, as
    a shorter one (192 before runs of rows) would be: the mode's own switch, every
    row on the native kernel, is then what keeps the probe's prefill off SDPA, and a
    300-token probe tests it instead of one past 2,048 tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_backend, "ROWS_MAX_KEYS", 192)
        yield


@pytest.fixture(scope="module")
def whole(default_model_dir: str) -> Iterator[LLM]:
    with engine(default_model_dir, num_gpu_blocks=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def chunked(default_model_dir: str) -> Iterator[LLM]:
    with engine(default_model_dir, num_gpu_blocks=256, max_num_batched_tokens=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(whole: LLM) -> dict[str, CompletionOutput]:
    return {name: run(whole.engine, [(0, "probe", PROBE, p, {})])["probe"]
            for name, p in PARAMS.items()}


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_probe_in_a_chunked_crowd_equals_probe_alone(
        chunked: LLM, alone: dict[str, CompletionOutput], kind: str) -> None:
    assert_same(run(chunked.engine, crowd(PARAMS[kind]))["probe"], alone[kind])


def test_prefix_hit_gives_the_computed_bits(chunked: LLM,
                                            alone: dict[str, CompletionOutput]) -> None:
    eng = chunked.engine
    eng.reset_prefix_cache()
    hits_before = eng.get_stats()["prefix_cache_hits"]
    sharer = PROBE[:200] + OTHERS[0]
    run(eng, [(0, "sharer", sharer, SamplingParams(max_tokens=2), {})])
    got = run(eng, [(0, "probe", PROBE, GREEDY, {})])["probe"]
    assert eng.get_stats()["prefix_cache_hits"] > hits_before
    assert_same(got, alone["greedy"])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_probe_equals_probe_alone(default_model_dir: str, mode: str,
                                            alone: dict[str, CompletionOutput]) -> None:
    # 30 blocks of 16: the probe (19 blocks at its end) and the crowd cannot all fit.
    with engine(default_model_dir, num_gpu_blocks=30, preemption_mode=mode,
                      max_num_batched_tokens=128) as llm:
        got = run(llm.engine, crowd(GREEDY))
        assert llm.engine.get_stats()["num_preemptions"][mode] > 0
        assert_same(got["probe"], alone["greedy"])


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_resumed_probe_in_a_crowd_equals_probe_alone(
        chunked: LLM, alone: dict[str, CompletionOutput], kind: str) -> None:
    want = alone[kind]
    schedule = crowd(PARAMS[kind])
    schedule[2] = (1, "probe", PROBE, PARAMS[kind],
                   {"resumed_token_ids": want.token_ids[:9]})
    got = run(chunked.engine, schedule)["probe"]
    assert got.token_ids == want.token_ids
    assert got.logprobs[9:] == want.logprobs[9:]


def test_speculative_decoding_gives_the_plain_bits(
        default_model_dir: str, alone: dict[str, CompletionOutput]) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with engine(default_model_dir, num_gpu_blocks=256, speculative_config=spec) as llm:
        got = run(llm.engine, crowd(GREEDY))["probe"]
        assert llm.engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0
        assert_same(got, alone["greedy"])


def test_bf16_probe_in_a_crowd_equals_bf16_probe_alone(default_model_dir: str,
                                                     tmp_path: Path) -> None:
    """A random 2-layer model 512 wide: bf16 is emulated on CPUs without AVX512-BF16 (5x
    slower than fp32), and the reductions that could differ are per layer, not per depth."""
    model = write_random_checkpoint(tmp_path / "bf16", "llama", default_model_dir,
                                    hidden_size=512, intermediate_size=1024,
                                    num_attention_heads=8, num_key_value_heads=4)
    with engine(model, dtype="bfloat16", num_gpu_blocks=256,
                      max_num_batched_tokens=64) as llm:
        solo = run(llm.engine, [(0, "probe", PROBE, GREEDY, {})])["probe"]
        assert_same(run(llm.engine, crowd(GREEDY))["probe"], solo)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_probe_in_a_crowd_equals_quantized_probe_alone(
        default_model_dir: str, quantization: str) -> None:
    from pagedserve.kernels import cpu_int8

    if not cpu_int8.native_available():
        with pytest.raises(ValueError, match="batch_invariant does not cover"):
            LLM(batch_invariant=True, quantization=quantization, num_gpu_blocks=16)
        return
    # Alone with its prompt in one step, then chunked in a crowd (the int8 / int4 GEMMs
    # are row-invariant by themselves: what differs by default is the attention).
    with engine(default_model_dir, quantization=quantization, num_gpu_blocks=256) as llm:
        solo = run(llm.engine, [(0, "probe", PROBE, GREEDY, {})])["probe"]
    with engine(default_model_dir, quantization=quantization, num_gpu_blocks=256,
                      max_num_batched_tokens=64) as llm:
        assert_same(run(llm.engine, crowd(GREEDY))["probe"], solo)


def test_lora_probe_among_other_adapters_equals_lora_probe_alone(
        tmp_path: Path, default_model_dir: str) -> None:
    """A probe under one adapter, in a crowd under another adapter, the same one and
    none, on the native LoRA kernel (a 512-wide random Llama: the default mode fails
    this test)."""
    import tests.cluster.conftest  # noqa: F401  (lora_fixtures imports its fixtures)
    from pagedserve.scheduler.lora_request import LoRARequest
    from pagedserve.worker.testing import write_random_checkpoint
    from tests.cluster.lora_fixtures import ALL7, write_adapter

    model = write_random_checkpoint(tmp_path / "base", "llama", default_model_dir,
                                    hidden_size=512, intermediate_size=1024,
                                    num_attention_heads=8, num_key_value_heads=4)
    a1, a2 = (LoRARequest(f"a{i}", i, write_adapter(model, tmp_path / f"a{i}", i, ALL7))
              for i in (1, 2))
    with_a1 = {"lora_request": a1}
    with engine(model, num_gpu_blocks=256, enable_lora=True, max_loras=3) as llm:
        solo = run(llm.engine, [(0, "probe", PROBE, GREEDY, with_a1)])["probe"]
    schedule = crowd(GREEDY)
    for i, kwargs in ((0, {"lora_request": a2}), (2, with_a1), (3, with_a1),
                      (4, {"lora_request": a2})):  # 2: the probe
        schedule[i] = (*schedule[i][:4], kwargs)
    with engine(model, num_gpu_blocks=256, enable_lora=True, max_loras=3,
                      max_num_batched_tokens=64) as llm:
        assert_same(run(llm.engine, schedule)["probe"], solo)


@pytest.mark.parametrize("settings, field", [
    ({"device": "cuda"}, "device"),
    ({"attention_backend": "torch"}, "attention_backend"),
])
def test_uncovered_settings_are_refused_at_once(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"batch_invariant.*{field}"):
        EngineConfig(batch_invariant=True, **settings)


@pytest.mark.parametrize(("kind", "quantization"), [
    ("mixtral", None), ("qwen2_moe", None), ("qwen3_moe", None), ("mixtral", "int8")])
def test_moe_probe_in_a_chunked_crowd_equals_probe_alone(
        kind: str, quantization: str | None, request: pytest.FixtureRequest) -> None:
    # Random Mixtral (top 2, renormalised), Qwen2-MoE (a gated shared expert) and
    # Qwen3-MoE (top 3 of 8, a dense layer): routed experts on the native kernel (int8
    # experts on ``moe_int8``), the router and shared gate GEMMs padded. The default
    # mode fails this (its logprobs differ in the crowd).
    from pagedserve.kernels import cpu_int8

    if quantization and not cpu_int8.native_available():
        pytest.skip("no native int8 kernel on this CPU")
    model = request.getfixturevalue(f"tiny_{kind}_dir")
    with engine(model, num_gpu_blocks=128, quantization=quantization) as llm:
        solo = run(llm.engine, [(0, "probe", PROBE, GREEDY, {})])["probe"]
    with engine(model, num_gpu_blocks=256, max_num_batched_tokens=64,
                quantization=quantization) as llm:
        assert_same(run(llm.engine, crowd(GREEDY))["probe"], solo)


def test_uncovered_models_are_refused_at_load(tiny_llama_dir: str, default_model_dir: str,
                                              tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"batch_invariant .*float16"):
        LLM(model=tiny_llama_dir, batch_invariant=True, dtype="float16", num_gpu_blocks=16)
    # Experts 24 wide: off the native expert kernel (it takes multiples of 16).
    odd = write_random_checkpoint(tmp_path / "odd_moe", "mixtral", default_model_dir,
                                  intermediate_size=24)
    with pytest.raises(ValueError, match="batch_invariant does not cover MoE experts off"):
        LLM(model=odd, batch_invariant=True, num_gpu_blocks=16)
