"""Multi-LoRA serving through the real engine: greedy tokens equal Hugging Face + PEFT
for mixed batches of base-model and adapter prompts (under the adapter cap, chunked
prefill and both preemption modes); prefix-cache blocks are never shared across
adapters; no step runs more than ``max_loras`` adapters; bad adapters and bad uses
are ``ValueError``s that leave the engine usable and the pool at its baseline."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from tests.cluster.lora_fixtures import (
    ALL7,
    GREEDY,
    PROMPTS,
    _tokens,
    expected,
    hf_peft_greedy,
    mixed_batch,
    write_adapter,
)
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


@pytest.mark.parametrize("kw", [
    {"max_loras": 1},  # the cap serializes the adapters
    {"max_loras": 3},  # all of them in one step
    {"max_loras": 2, "max_num_batched_tokens": 8},  # prompts in chunks of <= 8 rows
    {"max_loras": 3, "num_gpu_blocks": 24, "preemption_mode": "swap", "num_cpu_blocks": 128},
    {"max_loras": 3, "num_gpu_blocks": 24, "preemption_mode": "recompute"},
], ids=["max_loras=1", "max_loras=3", "chunked", "swap", "recompute"])
def test_mixed_batch_greedy_equals_hugging_face_peft(tiny_llama_dir, llama_loras, llama_refs,
                                                     kw) -> None:
    loras = [None, *llama_loras.values()]
    prompts, per_prompt = mixed_batch(loras)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, block_size=4,
              **{"num_gpu_blocks": 128, **kw})
    try:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=per_prompt)) == \
            expected(llama_refs, loras)
        mode = kw.get("preemption_mode")
        if mode is not None:
            assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert [r.lora_name for r in llm.engine.list_loras()] == ["all7", "qv_rs", "pattern"]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_adapters_with_speculative_decoding_and_parallel_sampling(tiny_llama_dir, llama_loras,
                                                                 llama_refs) -> None:
    """Drafted rows and forked samples run with their request's adapter."""
    loras = [None, *llama_loras.values()]
    prompts, per_prompt = mixed_batch(loras)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, num_gpu_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, n=2,
                                                    ignore_eos=True), lora_request=per_prompt)
        assert [[c.token_ids for c in o.outputs] for o in outs] == \
            [[t, t] for t in expected(llama_refs, loras)]
        assert llm.engine.get_stats()["spec_decode"]["num_drafts"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_adapters_with_a_draft_model(tiny_llama_dir, llama_loras, llama_refs) -> None:
    """A draft model guesses the base model's tokens; each row verifies them under its
    own adapter, so adapter outputs are PEFT's and base rows keep nearly every guess."""
    loras = [None, *llama_loras.values()]
    prompts, per_prompt = mixed_batch(loras)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=3, max_lora_rank=8,
              block_size=4, num_gpu_blocks=128,
              speculative_config={"model": tiny_llama_dir, "num_speculative_tokens": 3})
    try:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=per_prompt)) == \
            expected(llama_refs, loras)
        base = llm.engine.get_stats()["spec_decode"]
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == llama_refs[None]
        after = llm.engine.get_stats()["spec_decode"]
        kept = ((after["num_accepted_tokens"] - base["num_accepted_tokens"])
                / (after["num_draft_tokens"] - base["num_draft_tokens"]))
        assert kept > 0.95
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_qwen2_with_qkv_bias_and_tied_embeddings_equals_hugging_face_peft(
        tmp_path, tiny_qwen2_dir) -> None:
    loras = [None, LoRARequest("qw", 7, write_adapter(tiny_qwen2_dir, tmp_path / "qw", 4,
                                                      ALL7)),
             LoRARequest("qw_kv", 8, write_adapter(tiny_qwen2_dir, tmp_path / "qw_kv", 5,
                                                   ["k_proj", "v_proj", "up_proj"], r=2))]
    refs = {lora.lora_name if lora else None: hf_peft_greedy(
        tiny_qwen2_dir, lora.lora_path if lora else None, PROMPTS) for lora in loras}
    assert refs["qw"] != refs[None] and refs["qw_kv"] != refs[None]
    prompts, per_prompt = mixed_batch(loras)
    llm = LLM(model=tiny_qwen2_dir, enable_lora=True, max_loras=1, max_lora_rank=8,
              block_size=4, num_gpu_blocks=128, max_num_batched_tokens=8)
    try:
        outs = llm.generate(prompts, GREEDY, lora_request=per_prompt)
        assert _tokens(outs) == expected(refs, loras)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_alpha_pattern_regex_keys_scale_like_peft(tmp_path, tiny_llama_dir) -> None:
    """PEFT matches a pattern key as ``(.*\\.)?(key)$``: an alternation covers every
    module it names (here v_proj too, not only q_proj)."""
    path = write_adapter(tiny_llama_dir, tmp_path / "alt", 5, ["q_proj", "v_proj", "o_proj"],
                         r=4, alpha=4, alpha_pattern={"q_proj|v_proj": 64})
    ref = hf_peft_greedy(tiny_llama_dir, path, PROMPTS)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64)
    try:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("alt", 1, path))
        assert _tokens(outs) == ref
    finally:
        llm.shutdown()


def test_default_model_chat_with_adapter_equals_hugging_face_peft(
        tmp_path_factory, default_model_dir) -> None:
    path = write_adapter(default_model_dir, tmp_path_factory.mktemp("smol_lora"), 11,
                         ["q_proj", "v_proj"], r=8, alpha=16, scale=1.3)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    llm = LLM(enable_lora=True, max_lora_rank=8, num_gpu_blocks=64, max_num_seqs=4)
    try:
        tok = llm.get_tokenizer()
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        base, lora = llm.chat([messages, messages], params,
                              lora_request=[None, LoRARequest("smol", 1, path)])
        assert base.outputs[0].text == "The capital of France is Paris."
        assert lora.outputs[0].token_ids != base.outputs[0].token_ids
        assert lora.outputs[0].token_ids == hf_peft_greedy(default_model_dir, path, [ids], 16,
                                                           ignore_eos=False)[0]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_prefix_cache_blocks_are_never_shared_across_adapters(tiny_llama_dir, llama_loras
                                                              ) -> None:
    prompt = [(29 * j) % 3000 + 200 for j in range(56)]  # 3 full blocks of 16 and a tail
    a, b = llama_loras["all7"], llama_loras["qv_rs"]
    refs = {lora: hf_peft_greedy(tiny_llama_dir, lora.lora_path if lora else None, [prompt])[0]
            for lora in (None, a, b)}
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=16, num_gpu_blocks=64)
    try:
        def run(lora: LoRARequest | None) -> int:
            out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
            assert out.outputs[0].token_ids == refs[lora]
            return out.num_cached_tokens

        assert [run(None), run(a), run(a), run(b), run(b), run(None)] == [0, 0, 48, 0, 48, 48]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_stats_count_sequences_per_adapter_and_state(tiny_llama_dir, llama_loras) -> None:
    a, b = llama_loras["all7"], llama_loras["qv_rs"]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8,
              num_gpu_blocks=64)
    engine = llm.engine
    try:
        for i, lora in enumerate([a, a, b, None]):
            engine.add_request(PROMPTS[i], GREEDY, lora_request=lora)
        engine.step()  # the cap of one adapter: b waits while a runs
        lora = engine.get_stats()["lora"]
        assert (lora["running"], lora["waiting"], lora["swapped"]) == (
            {"all7": 2}, {"qv_rs": 1}, {})
        assert lora["loaded"] == ["all7", "qv_rs"] and lora["num_loaded"] == 2
        while engine.has_unfinished_requests():
            engine.step()
        lora = engine.get_stats()["lora"]
        assert lora["running"] == lora["waiting"] == {}
    finally:
        llm.shutdown()


def test_no_step_runs_more_than_max_loras_adapters(tiny_llama_dir, llama_loras, llama_refs
                                                   ) -> None:
    loras = [None, *llama_loras.values()]
    prompts, per_prompt = mixed_batch(loras)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks=128, block_size=4)
    engine = llm.engine
    try:
        for i, (p, lora) in enumerate(zip(prompts, per_prompt)):
            engine.add_request(p, GREEDY, request_id=f"r{i}", lora_request=lora)
        done: dict[str, list[int]] = {}
        per_step = []
        while engine.has_unfinished_requests():
            plan = engine.schedule()
            per_step.append({r.lora_id for r in plan.scheduled} - {0})
            running = {r.lora_id for r in engine.scheduler.running} - {0}
            assert len(per_step[-1]) <= 2 and len(running) <= 2, (per_step[-1], running)
            for out in engine.process(plan, engine.execute(plan)):
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert max(len(s) for s in per_step) == 2  # the cap is reached, not just respected
        assert set().union(*per_step) == {1, 2, 3}
        assert [done[f"r{i}"] for i in range(len(prompts))] == expected(llama_refs, loras)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bf16_native_deltas_agree_with_the_torch_form(tiny_llama_dir, llama_loras,
                                                      monkeypatch) -> None:
    """A bf16 model's adapters through the native CPU kernel (fp32 sums, one rounding)
    and through bf16 torch matmuls: both track the fp32 model's prompt logprobs within
    bf16 noise (the bf16 base weights' own, mostly), and the adapter's effect is far
    larger than that noise."""
    from pagedserve.kernels import cpu_lora

    prompt = {"prompt_token_ids": list(range(40, 90))}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(lora: LoRARequest | None, dtype: str) -> list[float]:
        llm = LLM(model=tiny_llama_dir, dtype=dtype, enable_lora=True, max_lora_rank=8,
                  num_gpu_blocks=32)
        try:
            out = llm.generate(prompt, params, lora_request=lora)[0]
        finally:
            llm.shutdown()
        ids = out.prompt_token_ids
        return [entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]

    def gap(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    lora = llama_loras["all7"]
    ref, base = logprobs(lora, "float32"), logprobs(None, "float32")
    native = logprobs(lora, "bfloat16")
    monkeypatch.setattr(cpu_lora, "available", lambda device, dtype: False)
    torch_form = logprobs(lora, "bfloat16")
    err_native, err_torch = gap(native, ref), gap(torch_form, ref)
    assert err_native < 0.5 and err_torch < 0.5, (err_native, err_torch)
    assert gap(ref, base) > 3 * max(err_native, err_torch), (gap(ref, base), err_native)
