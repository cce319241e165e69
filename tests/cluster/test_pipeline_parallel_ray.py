"""Pipeline parallelism over Ray actors: stages of layers, hidden states handed on
through the object store. Greedy tokens equal Hugging Face's (mixed batches, chunked
prefill, prefix-cache hits) with one plan per stage in flight, PP x TP equals TP=1,
logprobs, seeded samples, constraints, stop strings and speculative decoding equal
one rank's, preemption and KV offloading give the same tokens, streams aborted
mid-generation free everything, a killed stage fails the engine cleanly, and what
stages cannot serve is refused before any actor starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
from types import SimpleNamespace

import pytest

from pagedserve.cluster import LLM, BeamSearchParams, SamplingParams
from pagedserve.cluster.async_engine import AsyncEngine
from pagedserve.cluster.config import EngineConfig
from pagedserve.worker.testing import write_random_checkpoint
from pagedserve.worker.testing_eagle import write_guessing_pair, write_random_eagle
from pagedserve.worker.testing_mtp import write_guessing_mtp_model
from pagedserve.worker.testing_qwen3_next_mtp import add_random_qwen3_next_mtp
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_eagle import assert_every_guess_kept
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory, default_model_dir) -> str:
    """Three layers: two stages of 2 and 1 (the uneven split)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("pp_llama"), "llama",
                                   default_model_dir, num_hidden_layers=3)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_pp2_equals_hugging_face(ray_cluster, three_layer_llama) -> None:
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(three_layer_llama, prompts, 12)
    whole = LLM(model=three_layer_llama, num_gpu_blocks=64)
    try:
        whole_bytes = whole.engine.model_info["bytes_per_block"]
    finally:
        whole.shutdown()
    # A step budget of 24 tokens splits the longer prompts over several steps.
    llm = LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=64,
              num_threads=1, max_num_batched_tokens=24)
    try:
        info = llm.engine.model_info
        assert info["pipeline_parallel_size"] == 2
        # A block costs the larger stage (2 of 3 layers) what it costs it, not the whole.
        assert info["bytes_per_block"] * 3 == whole_bytes * 2
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        # One plan per stage in flight: most plans started while another was running.
        stats = llm.engine.get_stats()
        assert llm.engine.max_concurrent_batches == 2
        assert stats["pipelined_steps"] > stats["steps"] / 3
        # The same prompts again hit the prefix cache on every stage's pool.
        again = llm.generate(prompts, GREEDY)
        assert _tokens(again) == ref
        assert sum(o.num_cached_tokens for o in again) > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_tp2_equals_tp1(ray_cluster, tiny_llama_dir) -> None:
    """Four actors: two stages, each a gloo group of two ranks splitting the KV heads;
    rank 0 of the last stage samples."""
    prompts = prompts_of_mixed_lengths(4)
    tp1 = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        ref = _tokens(tp1.generate(prompts, GREEDY))
        seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
        ref_seeded = _tokens(tp1.generate(prompts, seeded))
    finally:
        tp1.shutdown()
    llm = LLM(model=tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2,
              num_gpu_blocks=64, num_threads=1)
    try:
        assert len(llm.engine.executor.workers) == 4
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert _tokens(llm.generate(prompts, seeded)) == ref_seeded
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_tp2_expert_parallel_equals_hugging_face(ray_cluster, tiny_mixtral_dir) -> None:
    """Expert parallelism inside each stage's TP group (2 of Mixtral's 4 experts a rank,
    one routed layer a stage): HF's greedy tokens; the last stage's rank 0 counts its
    layer's pairs, 2 for each token it ran."""
    prompts = prompts_of_mixed_lengths(4)
    llm = LLM(model=tiny_mixtral_dir, pipeline_parallel_size=2, tensor_parallel_size=2,
              num_gpu_blocks=64, num_threads=1, enable_expert_parallel=True)
    try:
        assert llm.engine.model_info["expert_parallel"]
        assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy(tiny_mixtral_dir, prompts,
                                                                    12)
        stats = llm.engine.get_stats()
        assert stats["expert_parallel_routed_pairs"] == 2 * (sum(map(len, prompts)) + 4 * 11)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_tp2_hybrid_gemma_equals_hugging_face(ray_cluster, tiny_gemma3_dir) -> None:
    """A Gemma 3 of a sliding, a full and a sliding layer: three KV cache groups, each
    table sent to four actors as changes (released fronts included), each stage's
    layers on its own caches (stage 0: layers 0 and 1, groups 1 and 0, one cache; stage
    1: layer 2, group 2); 12 new tokens, past the 8-token window, are HF's."""
    prompts = prompts_of_mixed_lengths(4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = hf_greedy(tiny_gemma3_dir, prompts, 12)
    llm = LLM(model=tiny_gemma3_dir, pipeline_parallel_size=2, tensor_parallel_size=2,
              num_gpu_blocks=96, num_threads=1, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert llm.engine.scheduler.kv.group_windows == (None, 8, 8)
        assert _tokens(llm.generate(prompts, params)) == ref
        assert _tokens(llm.generate(prompts, params)) == ref  # prefix hits in every group
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_gemma3_with_images_equals_hugging_face(ray_cluster, tmp_path_factory) -> None:
    """Images through two stages: the first encodes them and hands on hidden states,
    both attend with the images' bidirectional spans; chunked, with plans in flight."""
    from pagedserve.worker.testing import write_random_gemma3_multimodal
    from tests.cluster.test_gemma3_images import cases, generate, hf_reference

    model = write_random_gemma3_multimodal(tmp_path_factory.mktemp("pp_gemma3_images"))
    ref = hf_reference(model, cases(), 10)
    llm = LLM(model=model, pipeline_parallel_size=2, num_gpu_blocks=96, num_threads=1,
              max_num_batched_tokens=24, max_num_seqs=4)
    try:
        assert generate(llm, cases()) == ref
        assert llm.engine.get_stats()["pipelined_steps"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_pp2_forced_preemption_gives_the_same_tokens(ray_cluster, three_layer_llama,
                                                     mode: str) -> None:
    """Swaps travel in the plan and every stage moves its own layers' blocks."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(three_layer_llama, prompts, 12)
    llm = LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=12,
              preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0,
              max_num_batched_tokens=64, num_threads=1)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_hybrid_with_its_mtp_module_plans_in_flight_and_swaps(
        ray_cluster, tmp_path, default_model_dir) -> None:
    """Qwen3-Next in two stages (two DeltaNet layers; one and the attention layer):
    each stage keeps its own layers' states, the MTP module drafts beside the last
    stage's sampler, and a rejection rolls every stage's states back."""
    path = add_random_qwen3_next_mtp(write_random_checkpoint(
        tmp_path / "qwen3_next", "qwen3_next", default_model_dir))
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(path, prompts, 12)
    llm = LLM(model=path, pipeline_parallel_size=2, num_gpu_blocks=28, block_size=4,
              preemption_mode="swap", num_cpu_blocks=64, max_num_batched_tokens=64,
              num_threads=1, speculative_config={"method": "mtp",
                                                 "num_speculative_tokens": 2})
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert llm.engine.scheduler.num_preemptions["swap"] > 0
        spec = llm.engine.get_stats()["spec_decode"]
        assert 0 <= spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_draft_model_with_plans_in_flight_and_swaps(ray_cluster, three_layer_llama,
                                                       tiny_llama_dir) -> None:
    """The draft lives beside the last stage's sampler: its proposals come back with
    each plan's tokens, and its own pool follows the plan's swaps."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(three_layer_llama, prompts, 12)
    llm = LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=12,
              preemption_mode="swap", num_cpu_blocks=64, max_num_batched_tokens=64,
              num_threads=1, speculative_config={"model": three_layer_llama,
                                                 "num_speculative_tokens": 3})
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert llm.engine.scheduler.num_preemptions["swap"] > 0
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_accepted_tokens"] > 0.9 * spec["num_draft_tokens"] > 0, spec
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"speculative_config\.model"):  # (the last stage's)
        LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=16,
            speculative_config={"model": tiny_llama_dir + "-missing"})


def test_pp2_eagle_head_drafts_on_the_last_stage(ray_cluster, default_model_dir,
                                                 tmp_path) -> None:
    """The last stage's rank 0 holds the head, with the embedding (on the first stage)
    read from the checkpoint: a head that guesses right keeps every guess. EAGLE-3,
    which reads layers of both stages, is refused before any actor starts."""
    target, head = write_guessing_pair(tmp_path / "pair", default_model_dir, num_layers=3)
    prompts = prompts_of_mixed_lengths(4)
    assert_every_guess_kept(LLM(model=target, pipeline_parallel_size=2, num_gpu_blocks=64,
                                num_threads=1, speculative_config={
                                    "method": "eagle", "model": head,
                                    "num_speculative_tokens": 3}), target, prompts, 12)
    e3 = write_random_eagle(tmp_path / "e3", target, "eagle3", aux_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        LLM(model=target, pipeline_parallel_size=2, num_gpu_blocks=64,
            speculative_config={"method": "eagle3", "model": e3})


def test_pp2_mtp_layer_drafts_on_the_last_stage(ray_cluster, default_model_dir,
                                                tmp_path) -> None:
    """DeepSeek-V3's own MTP layer, held by the last stage's rank 0 with the embedding
    (on the first stage) read from the checkpoint, and the decoder skipping the MTP
    layer on every stage: a layer that guesses right keeps every guess, the tokens HF's."""
    model = write_guessing_mtp_model(tmp_path / "v3", default_model_dir, num_hidden_layers=3,
                                     num_key_value_heads=4, max_position_embeddings=256)
    prompts = prompts_of_mixed_lengths(4)
    assert_every_guess_kept(LLM(model=model, pipeline_parallel_size=2, num_gpu_blocks=64,
                                num_threads=1, speculative_config={
                                    "method": "deepseek_mtp", "num_speculative_tokens": 2}),
                            model, prompts, 12)


def test_pp2_sampling_features_equal_one_rank(ray_cluster, three_layer_llama) -> None:
    """With plans in flight, what the last stage's sampler and the driver do per request
    gives a single rank's outputs: logprobs and prompt logprobs, seeded ``n=2``, a regex
    constraint, a stop string, and n-gram speculative decoding under all of them."""
    from pagedserve.scheduler.sampling_params import StructuredOutputs

    prompts = ["Hello there, how are you", "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3",
               "The capital of France is", "abc abc abc abc abc"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1,
                       ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12,
                       structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-c]")),
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

    def run(**kw: object) -> tuple[list, dict]:
        llm = LLM(model=three_layer_llama, num_gpu_blocks=128, num_threads=1,
                  speculative_config=spec, **kw)
        try:
            if len(params) == 3:  # the stop string: a piece of the last prompt's own text
                (free,) = llm.generate(prompts[3], SamplingParams(temperature=0.0,
                                                                  max_tokens=20))
                stop = free.outputs[0].text.strip()[8:12]
                params.append(SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]))
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert_pool_at_baseline(llm)
            return outs, llm.engine.get_stats()
        finally:
            llm.shutdown()

    ref, _ = run()
    got, stats = run(pipeline_parallel_size=2)
    assert stats["pipelined_steps"] > 0 and stats["spec_decode"]["num_draft_tokens"] > 0
    for r, g in zip(ref, got, strict=True):
        assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in r.outputs]
    assert got[2].outputs[0].text[:3].isdigit()
    assert got[3].outputs[0].finish_reason == "stop"

    def values(lps: list) -> list[float]:
        return [v for d in lps if d for v in d.values()]

    assert len(values(got[0].outputs[0].logprobs)) >= 24
    assert values(got[0].outputs[0].logprobs) == pytest.approx(
        values(ref[0].outputs[0].logprobs), abs=1e-4)
    assert values(got[0].prompt_logprobs) == pytest.approx(values(ref[0].prompt_logprobs),
                                                           abs=1e-4)


def test_pp2_offloaded_prefixes_come_back_with_plans_in_flight(ray_cluster,
                                                               three_layer_llama) -> None:
    """KV offloading under pipelined plans: each round sends the next turn of three
    conversations at once (plans in flight), the pool holds less than one round, and
    the earlier turns' evicted prefixes come back from every stage's CPU tier with
    the tokens of a single rank that computes everything."""
    from tests.cluster.test_kv_offload import PARAMS, conversations

    turns = conversations()
    rounds = [turns[i:i + 3] for i in range(0, len(turns), 3)]

    def run(llm: LLM) -> list[list[int]]:
        return [t for r in rounds for t in _tokens(llm.generate(
            [{"prompt_token_ids": p} for p in r], PARAMS, use_tqdm=False))]

    one = LLM(model=three_layer_llama, num_gpu_blocks=256, enable_prefix_caching=False)
    try:
        ref = run(one)
    finally:
        one.shutdown()
    llm = LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=14,
              num_offload_blocks=60, block_size=16, num_threads=1)
    try:
        assert run(llm) == ref
        stats = llm.engine.get_stats()
        assert stats["kv_offload"]["loaded_blocks"] > 0, stats["kv_offload"]
        assert stats["pipelined_steps"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_pp2_offline_sleep_after_an_interrupted_generate(ray_cluster,
                                                         three_layer_llama) -> None:
    """An offline batch cut short while two plans cross the stages (what ``LLM.generate``
    does on Ctrl-C: abort its requests) leaves plans in flight with no request; ``sleep``
    collects them instead of refusing, and after ``wake_up`` a batch gives HF's tokens."""
    prompts = prompts_of_mixed_lengths(6)
    ref = hf_greedy(three_layer_llama, prompts, 12)
    llm = LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=64,
              num_threads=1)
    try:
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        for _ in range(3):  # prompts done, decoding in two micro-batches
            engine.step()
        engine.submit_plans()
        assert len(engine.pipeline) == 2
        for rid in ids:
            engine.abort_request(rid)
        assert engine.pipeline and not engine._groups
        llm.sleep()
        llm.wake_up()
        assert not engine.has_unfinished_requests()
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("depth,partition", [(2, None), (1, None), (2, "1,2")])
def test_pp2_streams_aborted_mid_generation_free_everything(ray_cluster, three_layer_llama,
                                                            depth: int, partition: str | None
                                                            ) -> None:
    """Async serving with both stages busy: half the streams are dropped after a few
    tokens (their plans may still be in flight), the rest finish with Hugging Face's
    tokens, the engine can sleep at once (the aborted plans still crossing the stages
    are waited for, not refused as busy), and the pool is back at baseline.
    ``depth=1`` (no overlap) too, and stages of 1 and 2 layers instead of 2 and 1."""
    prompts = prompts_of_mixed_lengths(8)
    ref = hf_greedy(three_layer_llama, prompts, 12)

    async def scenario() -> tuple[list[list[int] | None], AsyncEngine]:
        engine = AsyncEngine(EngineConfig(model=three_layer_llama, pipeline_parallel_size=2,
                                          num_gpu_blocks=64, num_threads=1,
                                          max_num_batched_tokens=32,
                                          max_concurrent_batches=depth,
                                          pipeline_layer_partition=partition))

        async def consume(i: int, prompt: list[int]) -> list[int] | None:
            async with contextlib.aclosing(engine.generate(prompt, GREEDY)) as stream:
                async for out in stream:
                    if i % 2 and len(out.outputs[0].token_ids) >= 1 + i // 2:
                        return None  # closing the stream aborts the request
                    tokens = out.outputs[0].token_ids
            return tokens

        try:
            got = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
            await engine.sleep()  # not refused while aborted plans are still coming back
            assert not engine.engine.has_unfinished_requests()
            await engine.wake_up()
        finally:
            await engine.shutdown()
        return got, engine

    got, engine = asyncio.run(scenario())
    assert [t for t in got if t is not None] == ref[0::2]
    assert all(t is None for t in got[1::2])
    stats = engine.engine.get_stats()
    assert stats["aborted_requests"] == 4
    assert (stats["pipelined_steps"] > 0) == (depth == 2)
    assert engine.engine.model_info["pipeline_layer_partition"] == ([1, 2] if partition
                                                                     else [2, 1])
    assert_pool_at_baseline(SimpleNamespace(engine=engine.engine))


def test_pp2_beam_search_with_beams_in_two_plans_equals_one_rank(ray_cluster,
                                                                 three_layer_llama) -> None:
    """A beam group's rows may be split over the two plans in flight (each beam is held
    until its siblings report): the beams equal a single rank's."""
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of_mixed_lengths(3)]
    one = LLM(model=three_layer_llama, num_gpu_blocks=256, block_size=4)
    try:
        ref = [[s.completion_token_ids for s in o.sequences]
               for o in one.beam_search(prompts, params)]
    finally:
        one.shutdown()
    llm = LLM(model=three_layer_llama, pipeline_parallel_size=2, num_gpu_blocks=256,
              block_size=4, num_threads=1)
    try:
        got = [[s.completion_token_ids for s in o.sequences]
               for o in llm.beam_search(prompts, params)]
        assert llm.engine.get_stats()["pipelined_steps"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    assert got == ref


@pytest.mark.parametrize("stage", [1, 0], ids=["sampling stage", "first stage"])
def test_killed_stage_fails_requests_and_frees_the_pool(ray_cluster, tiny_llama_dir,
                                                        stage: int) -> None:
    """Killed with two plans in flight: the engine's next step raises (no plan waits
    for a predecessor that never comes) and failing everything frees the pool."""
    llm = LLM(model=tiny_llama_dir, pipeline_parallel_size=2, num_gpu_blocks=64,
              num_threads=1)
    try:
        engine = llm.engine
        for i in range(4):
            engine.add_request([5, 6, 7, 8 + i], SamplingParams(max_tokens=100,
                                                                ignore_eos=True))
        engine.step()
        engine.submit_plans()
        assert len(engine.pipeline) == 2
        ray.kill(engine.executor.stages[stage][0])
        with pytest.raises(Exception, match="tensor-parallel group failed"):
            for _ in range(50):
                engine.step()
        engine.fail_all(RuntimeError("stage died"))
        assert_pool_at_baseline(llm)
        with pytest.raises(RuntimeError, match="dead"):
            engine.check_health()
    finally:
        llm.shutdown()


def test_what_stages_cannot_serve_is_refused_before_any_actor(ray_cluster, tiny_llama_dir
                                                              ) -> None:
    before = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="enable_lora is not supported"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="needs executor 'ray'"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=2, executor="local")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"max_concurrent_batches must be an integer from 1 to "
                                         r"pipeline_parallel_size \(2\), got 3"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=2, max_concurrent_batches=3)
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        LLM(model=tiny_llama_dir, max_concurrent_batches=2)
    with pytest.raises(ValueError, match="holds 3 layers; the model has 2"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=2, pipeline_layer_partition="2,1")
    with pytest.raises(ValueError, match="comma-separated layer counts such as"):
        LLM(model=tiny_llama_dir, pipeline_parallel_size=2, pipeline_layer_partition="1;1")
    assert len(ray.util.placement_group_table()) == before  # no stage was placed
