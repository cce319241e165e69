"""A prompt's KV shipped from a prefill engine to a decode engine: the decode engine's
answers are the ones it gives alone, it computes only what it was not sent, and both
pools end at baseline."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.async_engine import AsyncEngine
from pagedserve.cluster.kv_transfer import KVPayload, import_prompt_kv
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=12,
                        ignore_eos=True)


def prefill(llm: LLM, prompts: list[list[int]], **kwargs) -> list[KVPayload]:
    """What a prefill replica does: one thrown-away token per prompt, KV exported."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=1), f"pf-{i}", export_kv=True,
                           **kwargs)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.kv_transfer
    return [done[f"pf-{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """A prefill engine, a decode engine and a plain one with the same settings."""
    made = [LLM(model=tiny_llama_dir, num_gpu_blocks=128) for _ in range(3)]
    yield made
    for llm in made:
        llm.shutdown()


def expected_hits(n_tokens: int, block_size: int) -> int:
    return (n_tokens - 1) // block_size * block_size  # the last token is always computed


def test_decode_engine_answers_as_alone_and_computes_only_the_tail(engines) -> None:
    prefill_llm, decode_llm, plain = engines
    prompts = prompts_of_mixed_lengths()
    ref = plain.generate(prompts, GREEDY)
    ref_seeded = plain.generate(prompts, SEEDED)
    B = decode_llm.engine.scheduler.block_size
    payloads = prefill(prefill_llm, prompts)
    assert [p.num_blocks for p in payloads] == [len(p) // B for p in prompts]
    assert all(p.nbytes > 0 for p in payloads if p.num_blocks)
    imported = [import_prompt_kv(decode_llm.engine, p) for p in payloads]
    assert imported == [p.num_blocks for p in payloads]
    outs = decode_llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.num_cached_tokens for o in outs] == [expected_hits(len(p), B) for p in prompts]
    # Seeded sampling too (n=2: the samples fork after the imported prefix).
    for p in payloads:
        import_prompt_kv(decode_llm.engine, p)  # already there: nothing new to write
    seeded = decode_llm.generate(prompts, SEEDED)
    assert [[c.token_ids for c in o.outputs] for o in seeded] == \
        [[c.token_ids for c in o.outputs] for o in ref_seeded]
    stats = decode_llm.engine.get_stats()
    assert stats["kv_imported_blocks"] == sum(imported) and stats["kv_import_failures"] == 0
    assert prefill_llm.engine.get_stats()["kv_exported_blocks"] == sum(imported)
    for llm in engines:
        assert_pool_at_baseline(llm)


def test_salted_and_unsalted_prompts_stay_apart(engines) -> None:
    prefill_llm, decode_llm, _ = engines
    prompt = [(7 * j) % 3000 + 200 for j in range(40)]
    payload = prefill(prefill_llm, [prompt], cache_salt="tenant-a")[0]
    import_prompt_kv(decode_llm.engine, payload)
    engine = decode_llm.engine
    engine.add_request(prompt, GREEDY, "other-tenant", cache_salt="tenant-b")
    engine.add_request(prompt, GREEDY, "same-tenant", cache_salt="tenant-a")
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached[out.request_id] = out.num_cached_tokens
    assert cached == {"other-tenant": 0, "same-tenant": 32}
    assert_pool_at_baseline(decode_llm)


def test_a_payload_from_other_settings_is_refused_and_changes_nothing(engines) -> None:
    prefill_llm, decode_llm, _ = engines
    payload = prefill(prefill_llm, [list(range(300, 340))])[0]
    free = decode_llm.engine.scheduler.kv.pool.num_free_blocks
    for field, value in (("block_size", 32), ("kv_cache_dtype", "fp8_e4m3"),
                         ("tensor_parallel_size", 2), ("model_id", "another-model")):
        bad = dataclasses.replace(payload, layout=dataclasses.replace(payload.layout,
                                                                      **{field: value}))
        with pytest.raises(ValueError, match=field):
            import_prompt_kv(decode_llm.engine, bad)
    assert decode_llm.engine.scheduler.kv.pool.num_free_blocks == free
    assert_pool_at_baseline(decode_llm)


def test_a_write_that_fails_names_no_block(engines, monkeypatch) -> None:
    prefill_llm, decode_llm, plain = engines
    prompt = [(11 * j) % 3000 + 400 for j in range(50)]
    payload = prefill(prefill_llm, [prompt])[0]

    def broken(*_):
        raise RuntimeError("link down")

    monkeypatch.setattr(decode_llm.engine.executor, "write_kv_blocks", broken)
    with pytest.raises(RuntimeError, match="link down"):
        import_prompt_kv(decode_llm.engine, payload)
    monkeypatch.undo()
    assert decode_llm.engine.get_stats()["kv_import_failures"] >= 1
    out = decode_llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0  # nothing of the failed write is ever hit
    assert out.outputs[0].token_ids == plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_pool_at_baseline(decode_llm)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_narrow_kv_pools_ship_their_own_bytes(tiny_llama_dir, kv_cache_dtype) -> None:
    made = [LLM(model=tiny_llama_dir, num_gpu_blocks=64, kv_cache_dtype=kv_cache_dtype)
            for _ in range(3)]
    try:
        prefill_llm, decode_llm, plain = made
        prompts = prompts_of_mixed_lengths(4)
        ref = plain.generate(prompts, GREEDY)
        payloads = prefill(prefill_llm, prompts)
        want = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]
        assert all(k.dtype == v.dtype == want for p in payloads for k, v in p.shards)
        for p in payloads:
            import_prompt_kv(decode_llm.engine, p)
        outs = decode_llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert sum(o.num_cached_tokens for o in outs) > 0
        for llm in made:
            assert_pool_at_baseline(llm)
    finally:
        for llm in made:
            llm.shutdown()


def test_async_import_then_generate_and_a_cancelled_import_frees_its_blocks(
        engines, monkeypatch) -> None:
    prefill_llm, decode_llm, plain = engines
    prompt = [(13 * j) % 3000 + 600 for j in range(70)]
    payload = prefill(prefill_llm, [prompt])[0]
    ref = plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
    engine = decode_llm.engine
    engine.scheduler.kv.pool.reset_prefix_cache()

    async def main() -> tuple[list[int], int]:
        aeng = AsyncEngine(engine=engine)
        try:
            assert await aeng.import_kv(payload) == payload.num_blocks
            last = None
            async for out in aeng.generate(prompt, GREEDY, "after-import"):
                last = out
            assert last is not None
            engine.scheduler.kv.pool.reset_prefix_cache()
            write, landed = engine.executor.write_kv_blocks, []

            def slow_write(*args):
                time.sleep(0.3)
                write(*args)
                landed.append(True)

            monkeypatch.setattr(engine.executor, "write_kv_blocks", slow_write)
            task = asyncio.ensure_future(aeng.import_kv(payload))
            await asyncio.sleep(0.05)  # the copy has started
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The blocks were released only after the copy into them had ended, and
            # since the import did not complete, none of them is named.
            assert landed == [True]
            assert not engine.scheduler.kv.cached_prefix(payload.block_hashes)
            return last.outputs[0].token_ids, last.num_cached_tokens
        finally:
            if aeng._loop_task is not None:
                aeng._loop_task.cancel()
            aeng._transfer_thread.shutdown(wait=True)
            aeng._step_thread.shutdown(wait=True)

    tokens, cached = asyncio.run(main())
    assert tokens == ref and cached == expected_hits(len(prompt), engine.scheduler.block_size)
    assert_pool_at_baseline(decode_llm)


@pytest.mark.parametrize("path", ["sync", "async"])
def test_with_offloading_an_import_keeps_the_prefixes_it_evicts(tiny_llama_dir, engines,
                                                                 path: str) -> None:
    """An 8-block decode pool that caches one prompt imports another of 7 blocks: the
    blocks it takes held the first prompt's prefix, which goes to the CPU tier first,
    so asking the first prompt again loads its blocks instead of computing them."""
    prefill_llm, _, plain = engines
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=8, num_offload_blocks=16)
    try:
        engine = llm.engine
        B = engine.scheduler.block_size
        first = [(17 * j) % 3000 + 500 for j in range(4 * B + 3)]
        other = [(19 * j) % 3000 + 700 for j in range(7 * B + 1)]
        ref = plain.generate([first], GREEDY)[0].outputs[0].token_ids
        assert llm.generate([first], GREEDY)[0].outputs[0].token_ids == ref
        payload = prefill(prefill_llm, [other])[0]
        assert payload.num_blocks == 7
        if path == "sync":
            assert import_prompt_kv(engine, payload) == 7
        else:
            async def main() -> int:
                aeng = AsyncEngine(engine=engine)
                try:
                    return await aeng.import_kv(payload)
                finally:
                    aeng._transfer_thread.shutdown(wait=True)
                    aeng._step_thread.shutdown(wait=True)

            assert asyncio.run(main()) == 7
        offloaded = engine.get_stats()["kv_offload"]["offloaded_blocks"]
        assert offloaded >= 3  # at least the prompt blocks the device lost
        again = llm.generate([first], GREEDY)[0]
        assert again.outputs[0].token_ids == ref
        assert again.num_cached_tokens == 4 * B  # device and CPU hits: all 4 full blocks
        assert engine.get_stats()["kv_offload"]["cpu_hit_tokens"] >= 3 * B
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_export_is_refused_for_beams_and_embeddings(engines) -> None:
    from pagedserve.cluster.beam_search import BeamSearchParams
    from pagedserve.scheduler.pooling_params import PoolingParams

    engine = engines[0].engine
    with pytest.raises(ValueError, match="export_kv"):
        engine.add_request([1, 2, 3], None, "b", beam=BeamSearchParams(2, 4), export_kv=True)
    with pytest.raises(ValueError, match="export_kv"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), "e",
                           pooling_params=PoolingParams(), export_kv=True)
    assert_pool_at_baseline(engines[0])


def test_an_adapters_kv_serves_that_adapter_only(tiny_llama_dir, llama_loras, llama_refs
                                                 ) -> None:
    """K/V computed under a LoRA adapter differ from the base model's: the shipped blocks
    carry the adapter in their hashes, so only that adapter's requests hit them."""
    from tests.cluster.lora_fixtures import PROMPTS

    lora = llama_loras["all7"]
    kw = dict(model=tiny_llama_dir, num_gpu_blocks=64, enable_lora=True, max_lora_rank=8)
    made = [LLM(**kw) for _ in range(2)]
    try:
        prefill_llm, decode_llm = made
        payloads = prefill(prefill_llm, PROMPTS, lora_request=lora)
        assert sum(import_prompt_kv(decode_llm.engine, p) for p in payloads) > 0
        outs = decode_llm.generate(PROMPTS, GREEDY, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == llama_refs["all7"]
        B = decode_llm.engine.scheduler.block_size
        assert [o.num_cached_tokens for o in outs] == [expected_hits(len(p), B)
                                                       for p in PROMPTS]
        base = decode_llm.generate([PROMPTS[-1]], GREEDY)[0]
        assert base.num_cached_tokens == 0 and base.outputs[0].token_ids == llama_refs[None][-1]
        for llm in made:
            assert_pool_at_baseline(llm)
    finally:
        for llm in made:
            llm.shutdown()
