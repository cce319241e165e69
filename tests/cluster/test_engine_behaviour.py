"""Preemption, parallel sampling, abort and admission errors through the real engine."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.async_engine import AsyncEngine
from pagedserve.cluster.config import EngineConfig
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths


def assert_pool_at_baseline(llm: LLM) -> None:
    sched = llm.engine.scheduler
    mem = sched.memory_stats()
    assert mem.num_free_blocks == mem.num_gpu_blocks
    assert mem.num_swapped_blocks == 0
    cpu = sched.kv.cpu_pool  # what no request holds is free or an offloaded prefix
    assert cpu.num_owned_blocks == 0
    assert cpu.num_free_blocks + cpu.num_cached_blocks == cpu.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert not sched.requests and not llm.engine._groups
    for h, b in sched.kv.pool.cached.items():
        assert b.block_hash == h


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts_of_mixed_lengths(), params)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_forced_preemption_gives_the_same_tokens(mode, tiny_llama_dir, reference) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=12, preemption_mode=mode,
              num_cpu_blocks=64 if mode == "swap" else 0, max_num_batched_tokens=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate(prompts_of_mixed_lengths(), params)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_parallel_sampling_shares_prompt_blocks_and_matches_seeded_runs(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=128)
    try:
        prompt = [(13 * j) % 3000 + 50 for j in range(40)]  # 3 blocks, the last partial
        params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
        engine = llm.engine
        engine.add_request(prompt, params, request_id="g")
        engine.step()  # the prompt prefill, then the fork
        mem = engine.scheduler.memory_stats()
        assert mem.num_used_blocks == 3 and mem.num_shared_blocks == 3
        while engine.has_unfinished_requests():
            engine.step()
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]
        samples = [c.token_ids for c in first.outputs]
        assert samples == [c.token_ids for c in again.outputs]
        assert len({tuple(s) for s in samples}) == 3
        for i, s in enumerate(samples):
            alone = llm.generate([prompt], SamplingParams(
                temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True))[0]
            assert alone.outputs[0].token_ids == s
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_abort_mid_generation_frees_everything(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        engine = llm.engine
        for i, p in enumerate(prompts_of_mixed_lengths(4)):
            engine.add_request(p, SamplingParams(n=2, max_tokens=50, ignore_eos=True,
                                                 temperature=0.5), request_id=f"r{i}")
        for _ in range(3):
            engine.step()
        assert engine.scheduler.memory_stats().num_used_blocks > 0
        for i in range(4):
            assert engine.abort_request(f"r{i}")
        assert_pool_at_baseline(llm)
        plan = engine.schedule()
        assert sorted(plan.aborted_ids) == sorted(
            [f"r{i}" for i in range(4)] + [f"r{i}#1" for i in range(4)])
        engine.process(plan, engine.execute(plan))
    finally:
        llm.shutdown()


def test_requests_that_can_never_fit_and_bad_params_raise_value_error(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=4, max_model_len=256)
    try:
        with pytest.raises(ValueError, match="KV blocks"):
            llm.generate([[5] * 60], SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="context"):
            llm.generate([[5] * 300], SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=-1)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0)
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=0)
        for bad in ([10**9], [5, -1], [5, 6.0], [5, "6"], [True, 5]):
            with pytest.raises(ValueError, match="vocabulary"):
                llm.generate([bad], SamplingParams(max_tokens=2))
        # A bad prompt late in a batch: the batch's earlier requests are withdrawn too.
        with pytest.raises(ValueError, match="context"):
            llm.generate([[5, 6], [7, 8], [5] * 300], SamplingParams(max_tokens=2))
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([{"text": "t5"}])
        engine = llm.engine
        with pytest.raises(ValueError, match="'#'"):
            engine.add_request([5, 6], request_id="a#0")
        taken = engine.add_request([5, 6], request_id=f"req-{next(engine._ids) + 1}")
        with pytest.raises(ValueError, match="already in use"):  # the next generated id
            engine.add_request([5, 6])
        with pytest.raises(ValueError, match="priority"):
            engine.add_request([5, 6], priority=1)
        engine.abort_request(taken)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) <= 3
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_skip_special_tokens_false_keeps_them_in_the_text(tiny_llama_dir) -> None:
    """The tiny model has SmolLM2's tokenizer; logit_bias makes it say <|im_start|>."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        tok = llm.get_tokenizer()
        special = tok.convert_tokens_to_ids("<|im_start|>")
        forced = dict(max_tokens=3, temperature=0.0, logit_bias={special: 100.0},
                      ignore_eos=True)
        out = llm.generate([[5, 6, 7]] * 2, [SamplingParams(**forced),
                                             SamplingParams(**forced, skip_special_tokens=False)])
        assert [o.outputs[0].token_ids for o in out] == [[special] * 3] * 2
        assert out[0].outputs[0].text == ""
        assert out[1].outputs[0].text == "<|im_start|>" * 3
        with pytest.raises(ValueError, match="skip_special_tokens"):
            SamplingParams(skip_special_tokens="no")
    finally:
        llm.shutdown()


def test_the_token_that_stops_a_sequence_is_not_in_its_text(tiny_llama_dir) -> None:
    """vLLM's rule: the EOS or stop token id that ends a sequence stays in
    ``token_ids`` but not in ``text``, unless ``include_stop_str_in_output``; so
    ``skip_special_tokens=False`` shows no trailing ``<|im_end|>`` and a plain-word stop
    id does not show its word."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        tok = llm.get_tokenizer()
        word = tok.encode(" Paris", add_special_tokens=False)[-1]
        eos = llm.engine.eos_token_ids[0]
        base = dict(max_tokens=4, temperature=0.0)
        cases = [SamplingParams(**base, logit_bias={word: 100.0}, stop_token_ids=[word]),
                 SamplingParams(**base, logit_bias={word: 100.0}, stop_token_ids=[word],
                                include_stop_str_in_output=True),
                 SamplingParams(**base, logit_bias={eos: 100.0}, skip_special_tokens=False),
                 SamplingParams(**base, logit_bias={eos: 100.0}, skip_special_tokens=False,
                                include_stop_str_in_output=True)]
        out = [o.outputs[0] for o in llm.generate([[5, 6, 7]] * 4, cases)]
        assert [o.token_ids for o in out] == [[word], [word], [eos], [eos]]
        assert [o.finish_reason for o in out] == ["stop"] * 4
        assert [o.stop_reason for o in out] == [word, word, None, None]
        assert [o.text for o in out] == ["", tok.decode([word]), "", tok.decode([eos])]
    finally:
        llm.shutdown()


def test_truncate_prompt_tokens_keeps_the_prompt_tail(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        prompt = list(range(100, 140))
        greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
        cut = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=12))[0]
        tail = llm.generate([prompt[-12:]], SamplingParams(**greedy))[0]
        assert cut.prompt_token_ids == prompt[-12:]
        assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=0)
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate([prompt], SamplingParams(allowed_token_ids=[10**7]))
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_vllm_prompt_dicts_equal_plain_prompts(tiny_llama_dir) -> None:
    """vLLM's TokensPrompt / TextPrompt dicts give what token lists and text give."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        plain = llm.generate([[5, 6, 7], "t9 t10 t11"], greedy)
        dicts = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "t9 t10 t11"}], greedy)
        assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
        single = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy)
        assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_stop_strings_and_logprobs(smol_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["Paris"], logprobs=2)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol_llm.chat(msgs, params)[0].outputs[0]
    assert out.text == "The capital of France is "
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert len(out.logprobs) == len(out.token_ids)
    assert all(len(lp) >= 1 for lp in out.logprobs)
    assert out.cumulative_logprob <= 0.0


def test_bad_words_are_never_generated(smol_llm) -> None:
    """vLLM's ``bad_words``: "Paris" (one token after a space) and "capital of France"
    (three tokens, banned only at its last one) do not appear; what comes before the
    first point where a ban bites is the unconstrained greedy answer."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    base = dict(temperature=0.0, max_tokens=12)
    free = smol_llm.chat(msgs, SamplingParams(**base))[0].outputs[0]
    assert free.text == "The capital of France is Paris."
    for word, kept in (("Paris", "The capital of France is"),
                       ("capital of France", "The capital of")):
        out = smol_llm.chat(msgs, SamplingParams(**base, bad_words=[word]))[0].outputs[0]
        assert word not in out.text and out.text.startswith(kept), out.text
        assert out.token_ids[:len(kept.split())] == free.token_ids[:len(kept.split())]
    with pytest.raises(ValueError, match="bad_words"):
        smol_llm.generate(["hi"], SamplingParams(bad_words=[""]))
    # Seeded samples keep the ban too, both siblings of n=2.
    out = smol_llm.chat(msgs, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12,
                                             bad_words=["Paris"]))[0]
    assert all("Paris" not in c.text for c in out.outputs)


def test_async_engine_cancellation_aborts_and_frees(tiny_llama_dir) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=64))
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)

            async def consume(prompt: list[int], stop_after: int | None,
                              p: SamplingParams = params) -> list[int]:
                got: list[int] = []
                async for out in engine.generate(prompt, p):
                    got = out.outputs[0].token_ids
                    if stop_after is not None and len(got) >= stop_after:
                        break
                return got

            prompts = prompts_of_mixed_lengths(4)
            long = SamplingParams(max_tokens=450, ignore_eos=True, temperature=0.0)
            task = asyncio.create_task(consume(prompts[0], None, long))
            res = await asyncio.gather(consume(prompts[1], 3), consume(prompts[2], 5),
                                       consume(prompts[3], None))
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(res[2]) == 200
            mem = engine.engine.scheduler.memory_stats()
            assert mem.num_free_blocks == mem.num_gpu_blocks
            assert not engine.engine._groups
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_async_engine_runs_every_forward_on_one_thread(tiny_llama_dir, monkeypatch) -> None:
    """OpenMP pools are per calling thread: the engine is built, and every forward runs, on
    one thread, never the caller's nor a default-pool thread."""
    import threading

    from pagedserve.cluster import async_engine

    built: set[int] = set()

    class SpyEngine(async_engine.LLMEngine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            built.add(threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(async_engine, "LLMEngine", SpyEngine)

    async def scenario() -> set[int]:
        engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=64))
        seen: set[int] = set()
        execute = engine.engine.execute

        def spy(plan: object) -> object:
            seen.add(threading.get_ident())
            return execute(plan)

        engine.engine.execute = spy  # type: ignore[method-assign]
        try:
            params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)

            async def consume(prompt: list[int]) -> None:
                async for _ in engine.generate(prompt, params):
                    await asyncio.to_thread(lambda: None)  # keep the default pool busy too

            for _ in range(3):
                await asyncio.gather(*(consume(p) for p in prompts_of_mixed_lengths(3)))
        finally:
            await engine.shutdown()
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 1 and threading.get_ident() not in seen
    assert built == seen


@pytest.mark.parametrize("phase", ["schedule", "process"])
def test_async_engine_error_outside_the_forward_fails_callers_instead_of_hanging(
        tiny_llama_dir, phase) -> None:
    """A scheduler or detokeniser error fails every open request at once, frees the pool,
    marks the engine dead for the health check, and rejects later requests."""
    from pagedserve.cluster.async_engine import EngineDeadError

    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, num_gpu_blocks=64))
        core = engine.engine
        real = getattr(core, phase)
        calls = 0

        def broken(*args: object) -> object:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise KeyError("scheduler bug")
            return real(*args)

        setattr(core, phase, broken)
        try:
            params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0)

            async def consume(prompt: list[int]) -> BaseException | None:
                try:
                    async for _ in engine.generate(prompt, params):
                        pass
                except EngineDeadError as e:
                    return e
                return None

            errors = await asyncio.wait_for(asyncio.gather(
                *(consume(p) for p in prompts_of_mixed_lengths(3))), timeout=60)
            assert all(isinstance(e, EngineDeadError) and "scheduler bug" in str(e)
                       for e in errors), errors
            mem = core.scheduler.memory_stats()
            assert mem.num_free_blocks == mem.num_gpu_blocks
            assert not core._groups
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate(prompts_of_mixed_lengths(1)[0], params):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
