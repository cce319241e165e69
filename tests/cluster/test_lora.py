"""Multi-LoRA serving through the real engine: greedy tokens equal Hugging Face + PEFT
for mixed batches of base-model and adapter prompts (under the adapter cap, chunked
prefill and both preemption modes); prefix-cache blocks are never shared across
adapters; no step runs more than ``max_loras`` adapters; bad adapters and bad uses
are ``ValueError``s that leave the engine usable and the pool at its baseline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from pagedserve.worker.testing import write_random_lora
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = prompts_of_mixed_lengths(4)  # 3, 12, 21 and 30 tokens


def write_adapter(base_dir: str, dest: Path, seed: int, targets: Any, r: int = 8,
                  alpha: float = 16, scale: float = 3.0, safe: bool = True,
                  **lora_kw: Any) -> str:
    """A random PEFT LoRA adapter saved by PEFT itself (``write_random_lora``)."""
    return write_random_lora(base_dir, dest, targets, r=r, alpha=alpha, seed=seed,
                             scale=scale, safe_serialization=safe, **lora_kw)


def hf_peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                   max_new_tokens: int = 16, ignore_eos: bool = True, device: str = "cpu"
                   ) -> list[list[int]]:
    """``PeftModel.from_pretrained(...).generate``, greedy, one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens if ignore_eos else 0,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def make_llama_adapters(root: Path, base_dir: str) -> dict[str, LoRARequest]:
    """Three adapters of the tiny Llama, each exercising another part of the loader."""
    return {
        "all7": LoRARequest("all7", 1, write_adapter(base_dir, root / "all7", 1, ALL7)),
        # rsLoRA scaling, saved as adapter_model.bin
        "qv_rs": LoRARequest("qv_rs", 2, write_adapter(
            base_dir, root / "qv_rs", 2, ["q_proj", "v_proj"], r=4, alpha=8,
            use_rslora=True, safe=False)),
        # per-module ranks and alphas; down_proj only in layer 1
        "pattern": LoRARequest("pattern", 3, write_adapter(
            base_dir, root / "pattern", 3, ["q_proj", "k_proj", "o_proj", "up_proj",
                                            "down_proj"], r=8, alpha=16,
            rank_pattern={"k_proj": 4, "model.layers.1.mlp.down_proj": 2},
            alpha_pattern={"o_proj": 40, "layers.0.self_attn.q_proj": 3})),
    }


def mixed_batch(loras: list[LoRARequest | None], prompts: list[list[int]] = PROMPTS
                ) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Every prompt under every adapter, interleaved so neighbours differ in adapter."""
    return [p for p in prompts for _ in loras], [lora for _ in prompts for lora in loras]


def expected(refs: dict[str | None, list[list[int]]], loras: list[LoRARequest | None],
             prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [refs[lora.lora_name if lora else None][i] for i in range(len(prompts))
            for lora in loras]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="session")
def llama_loras(tmp_path_factory, tiny_llama_dir) -> dict[str, LoRARequest]:
    return make_llama_adapters(tmp_path_factory.mktemp("llama_loras"), tiny_llama_dir)


@pytest.fixture(scope="session")
def llama_refs(tiny_llama_dir, llama_loras) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {None: hf_peft_greedy(tiny_llama_dir, None,
                                                                    PROMPTS)}
    for name, lora in llama_loras.items():
        refs[name] = hf_peft_greedy(tiny_llama_dir, lora.lora_path, PROMPTS)
        # Otherwise an engine that ignored the adapter would pass.
        assert all(a != b for a, b in zip(refs[name], refs[None])), name
    return refs


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


def _edited(src: str, dest: Path, **config: Any) -> str:
    """A copy of adapter ``src`` with its adapter_config.json fields replaced."""
    shutil.copytree(src, dest)
    cfg_path = dest / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config}))
    return str(dest)


def _renamed(src: str, dest: Path, old: str, new: str | None) -> str:
    """A copy of adapter ``src`` with tensor keys containing ``old`` renamed (None: dropped)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    f = dest / "adapter_model.safetensors"
    tensors = load_file(str(f))
    save_file({k if old not in k else k.replace(old, new): t for k, t in tensors.items()
               if new is not None or old not in k}, str(f))
    return str(dest)


def test_bad_adapters_and_bad_uses_are_value_errors(tmp_path, tiny_llama_dir, llama_loras,
                                                    llama_refs) -> None:
    good = llama_loras["all7"].lora_path
    bad: list[tuple[str, str]] = [
        (write_adapter(tiny_llama_dir, tmp_path / "r16", 6, ["q_proj"], r=16), "max_lora_rank"),
        (str(tmp_path / "missing"), "adapter_config.json"),
        (_edited(good, tmp_path / "dora", use_dora=True), "use_dora"),
        (_edited(good, tmp_path / "bias", bias="all"), "bias"),
        (_edited(good, tmp_path / "fan", fan_in_fan_out=True), "fan_in_fan_out"),
        (write_adapter(tiny_llama_dir, tmp_path / "mts", 6, ["q_proj"],
                       modules_to_save=["lm_head"]), "modules_to_save"),
        (write_adapter(tiny_llama_dir, tmp_path / "head", 6, ["q_proj", "lm_head"]),
         "lm_head"),
        (write_adapter(tiny_llama_dir, tmp_path / "emb", 6, ["embed_tokens"]), "embed_tokens"),
        (_renamed(good, tmp_path / "layer", "layers.1.", "layers.5."), "layer 5"),
        (_renamed(good, tmp_path / "noB", "layers.0.mlp.up_proj.lora_B", None),
         "without its pair"),
    ]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks=64)
    try:
        for i, (path, message) in enumerate(bad):
            with pytest.raises(ValueError, match=message):
                llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(f"bad{i}", 10 + i, path))
            assert llm.engine.list_loras() == []
            assert_pool_at_baseline(llm)
        all7 = llama_loras["all7"]
        assert llm.engine.add_lora(all7) and not llm.engine.add_lora(all7)
        with pytest.raises(ValueError, match="lora_int_id 1"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("other", 1,
                                                                   str(tmp_path / "r16")))
        with pytest.raises(ValueError, match="lora_name 'all7'"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("all7", 9, all7.lora_path))
        # One bad adapter late in a batch withdraws the whole batch.
        with pytest.raises(ValueError, match="use_dora"):
            llm.generate(PROMPTS[:2], GREEDY, lora_request=[
                all7, LoRARequest("dora", 20, str(tmp_path / "dora"))])
        assert llm.engine.list_loras() == [all7]
        assert_pool_at_baseline(llm)
        outs = llm.generate(PROMPTS, GREEDY, lora_request=all7)
        assert _tokens(outs) == llama_refs["all7"]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_lora_request_without_enable_lora_is_a_value_error(tiny_llama_dir, llama_loras
                                                           ) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate(PROMPTS, GREEDY, lora_request=llama_loras["all7"])
        with pytest.raises(ValueError, match="enable_lora"):
            llm.engine.add_lora(llama_loras["all7"])
        assert_pool_at_baseline(llm)
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == 16
    finally:
        llm.shutdown()


def test_remove_lora_is_refused_while_a_request_uses_it(tiny_llama_dir, llama_loras,
                                                        llama_refs) -> None:
    a = llama_loras["qv_rs"]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64)
    engine = llm.engine
    try:
        engine.add_request(PROMPTS[1], GREEDY, request_id="busy", lora_request=a)
        engine.step()
        with pytest.raises(ValueError, match="in use by 1"):
            engine.remove_lora("qv_rs")
        assert engine.list_loras() == [a]
        assert engine.abort_request("busy")
        assert engine.remove_lora(a.lora_int_id) is True  # by id, as vLLM's
        assert engine.remove_lora("qv_rs") is False and engine.remove_lora(2) is False
        assert engine.list_loras() == []
        assert_pool_at_baseline(llm)
        # A request naming it loads it again.
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=a)) == llama_refs["qv_rs"]
        assert engine.list_loras() == [a]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_the_least_recently_used_idle_adapter_is_unloaded_to_make_room(
        tiny_llama_dir, llama_loras, llama_refs) -> None:
    """``max_loaded_loras``: one more adapter unloads the LRU idle one, which its next
    request loads again; busy adapters are never unloaded (the cap waits for them)."""
    names = list(llama_loras)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64,
              max_loaded_loras=2)
    engine = llm.engine
    try:
        for name in [*names, names[0]]:  # all7, qv_rs, pattern (unloads all7), all7 again
            outs = llm.generate(PROMPTS, GREEDY, lora_request=llama_loras[name])
            assert _tokens(outs) == llama_refs[name], name
            assert len(engine.list_loras()) <= 2
        assert [r.lora_name for r in engine.list_loras()] == ["all7", "pattern"]  # by id
        lora = engine.get_stats()["lora"]
        assert lora["evictions"] == 2 and lora["num_loaded"] == 2  # all7, then qv_rs out
        # All three busy at once: nothing idle to unload, so all three are loaded.
        prompts, per_prompt = mixed_batch([None, *llama_loras.values()])
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=per_prompt)) == \
            expected(llama_refs, [None, *llama_loras.values()])
        assert len(engine.list_loras()) == 3
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_loaded_loras"):
        LLM(model=tiny_llama_dir, enable_lora=True, max_loras=3, max_loaded_loras=2)


def test_adapter_bytes_is_what_a_full_rank_adapter_takes(tmp_path, tiny_llama_dir) -> None:
    """What CUDA profiling keeps out of the KV pool per loaded adapter: exactly the
    device bytes of an adapter of rank ``max_lora_rank`` on all seven projections."""
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=16)
    try:
        worker = llm.engine.executor.worker
        assert worker.config.max_loaded_loras == 16
        path = write_adapter(tiny_llama_dir, tmp_path / "full", 7, ALL7, r=8)
        llm.engine.add_lora(LoRARequest("full", 1, path))
        manager = worker.lora
        held = sum(a.nbytes + b.nbytes for m in manager._modules()
                   for a, b in m.lora.adapters.values())
        assert held == manager.adapter_bytes() > 0
    finally:
        llm.shutdown()
