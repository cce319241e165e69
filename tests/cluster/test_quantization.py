"""``quantization="int8"`` through the engine: the default model keeps its answers
in less than half the memory, tokens do not depend on batching, chunking,
prefix hits or preemption, LoRA adapters still apply, MoE experts and embedding
models quantise, the torch path scores like the kernel, and bad settings are
refused naming the field.

(The kernel against its arithmetic is ``tests/kernels/test_kern_cpu_int8.py``;
TP=2 = TP=1 under int8 is in ``tests/worker/test_tensor_parallel.py``.)
"""

from __future__ import annotations

import glob

import pytest
import torch
from pydantic import ValidationError

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.serve_args import ServeArgs
from pagedserve.kernels import cpu_int8
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.lora_fixtures import PROMPTS, mixed_batch
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# A completion whose answer wins by ~2.5 nats in fp32. (The chat question's first token
# is a near-tie even in fp32: "The" over "L'" by 0.08 nats, inside int8's noise.)
FRANCE = "The capital of France is"


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _scores(llm: LLM, seqs: list[list[int]], start: int) -> list[tuple[int, float]]:
    """(top-1 token, logprob of the sequence's own token) from position ``start`` on."""
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [(max(d, key=d.get), d[t]) for o, s in zip(outs, seqs)
            for d, t in zip(o.prompt_logprobs[start:], s[start:])]


def test_default_model_int8_keeps_its_answers_in_less_memory() -> None:
    """SmolLM2 under int8 still completes Paris, holds < 45% of the fp32 engine's weight
    bytes, and, teacher-forced on fp32's own continuations, picks fp32's top-1 token
    >= 90% of the time (0.967 here; bench/quant.py's 64 prompts: 0.988)."""
    ref = LLM()
    try:
        fp32_bytes = ref.engine.model_info["weight_bytes"]
        tok = ref.get_tokenizer()
        prompts = [tok.encode(t) for t in ("The history of Paris begins",
                                           "def fibonacci(n):",
                                           "Paged attention stores the KV cache")]
        seqs = [p + o for p, o in zip(prompts, _tokens(ref.generate(prompts, GREEDY)))]
        want = _scores(ref, seqs, 6)
    finally:
        ref.shutdown()
    llm = LLM(quantization="int8")
    try:
        info = llm.engine.model_info
        assert info["quantization"] == "int8"
        assert info["weight_bytes"] < 0.45 * fp32_bytes
        mem = llm.engine.get_stats()["memory"]
        assert (mem["quantization"], mem["weight_bytes"]) == ("int8", info["weight_bytes"])
        out = llm.generate([FRANCE], SamplingParams(temperature=0.0, max_tokens=4))
        assert out[0].outputs[0].text.startswith(" Paris")
        got = _scores(llm, seqs, 6)
        agree = sum(a[0] == b[0] for a, b in zip(got, want)) / len(want)
        print(f"default model top-1 agreement with fp32: {agree:.4f} of {len(want)}")
        assert agree >= 0.9, agree
        assert sum(abs(a[1] - b[1]) for a, b in zip(got, want)) / len(want) < 0.2
        layer = llm.engine.executor.worker.model.layers[0]
        assert layer.self_attn.qkv_proj.quant is not None
        assert layer.self_attn.qkv_proj.weight.numel() == 0  # the fp32 copy is gone
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method,mode", [("int8", "swap"), ("int8", "recompute"),
                                         ("int4", "swap")])
def test_int8_tokens_do_not_depend_on_batching(method, mode, tiny_llama_dir) -> None:
    """Activations are quantised per row, so a prompt's tokens are the same alone, in a
    mixed batch, in 8-token chunks under forced preemption, and over prefix-cache hits."""
    prompts = prompts_of_mixed_lengths()
    alone_llm = LLM(model=tiny_llama_dir, quantization=method, num_gpu_blocks=256)
    try:
        alone = [_tokens(alone_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
        assert _tokens(alone_llm.generate(prompts, GREEDY, use_tqdm=False)) == alone
        assert _tokens(alone_llm.generate(prompts, GREEDY, use_tqdm=False)) == alone  # hits
        assert alone_llm.engine.scheduler.kv.prefix_hits > 0
    finally:
        alone_llm.shutdown()
    llm = LLM(model=tiny_llama_dir, quantization=method, block_size=4, num_gpu_blocks=24,
              preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0,
              max_num_batched_tokens=8)
    try:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_int4_serves_the_default_files_own_4bit_weights() -> None:
    """SmolLM2's GGUF holds its layers as Q4_1 blocks: "int4" (Q4_1's scheme) finds the
    same grid again, so every layer's 4-bit weight dequantises to exactly what the fp32
    engine loaded; the LM head (the file's Q8_0 embedding) keeps 8 bits; the weights
    shrink below int8's; the answer and the fidelity stay."""
    from safetensors import safe_open

    from pagedserve.worker.loaders import resolve_model

    llm = LLM(quantization="int4")
    try:
        model = llm.engine.executor.worker.model
        path = resolve_model(None).path
        files = sorted(glob.glob(f"{path}/*.safetensors"))
        with safe_open(files[0], "pt") as f:
            for i in (0, 17, 29):
                q = model.layers[i].mlp.down_proj.quant
                assert q.bits == 4 and q.packed  # two codes a byte, kernel or not
                want = f.get_tensor(f"model.layers.{i}.mlp.down_proj.weight").float()
                assert torch.equal(q.dequantize(), want)
        assert model.lm_head.quant.bits == 8
        assert llm.engine.model_info["weight_bytes"] < 220 * 2**20  # int8: 252 MiB
        out = llm.generate([FRANCE], SamplingParams(temperature=0.0, max_tokens=4))
        assert out[0].outputs[0].text.startswith(" Paris")
    finally:
        llm.shutdown()


def test_int8_tokens_follow_the_float_model(tiny_llama_dir) -> None:
    """On the random model the int8 engine's first greedy tokens are the fp32 engine's
    for most prompts: quantisation perturbs, it does not scramble."""
    prompts = prompts_of_mixed_lengths(12)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    toks = {}
    for quant in (None, "int8"):
        llm = LLM(model=tiny_llama_dir, quantization=quant, num_gpu_blocks=256)
        try:
            toks[quant] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
    same = sum(a[0] == b[0] for a, b in zip(toks[None], toks["int8"]))
    print(f"first tokens equal to fp32: {same} of {len(prompts)}")
    assert same >= 0.6 * len(prompts), (same, len(prompts))


def test_lora_adapters_apply_over_int8_weights(tiny_llama_dir, llama_loras) -> None:
    """Adapter deltas are added to the int8 projections' outputs: a mixed batch of two
    adapters and the base model gives each prompt what it gets alone under its adapter,
    and the adapters change the output."""
    loras = [None, llama_loras["all7"], llama_loras["pattern"]]
    llm = LLM(model=tiny_llama_dir, quantization="int8", enable_lora=True, max_loras=2,
              max_lora_rank=8, num_gpu_blocks=256)
    try:
        alone = {}
        for lora in loras:
            alone[lora.lora_name if lora else None] = _tokens(
                llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
        assert alone["all7"] != alone[None] and alone["pattern"] != alone[None]
        prompts, which = mixed_batch(loras)
        got = _tokens(llm.generate(prompts, GREEDY, lora_request=which, use_tqdm=False))
        assert got == [alone[lora.lora_name if lora else None][PROMPTS.index(p)]
                       for p, lora in zip(prompts, which)]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bad_quantization_settings_name_the_field(tmp_path, default_model_dir) -> None:
    for bad in ("int2", "bitsandbytes", "INT8"):
        with pytest.raises(ValueError, match="quantization"):
            EngineConfig(quantization=bad)
        with pytest.raises(ValidationError, match="quantization"):
            ServeArgs(quantization=bad, device="cpu")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda")
    for ok in ("int8", "int4", "gptq", "awq", "compressed-tensors", "fp8"):
        assert ServeArgs(quantization=ok, device="cpu").settings() \
            .engine_kwargs["quantization"] == ok
    EngineConfig(quantization="awq", device="cuda")  # the file's own, on any device
    # Inputs per rank must be whole groups of 32: hidden 48 is not.
    path = write_random_checkpoint(tmp_path / "h48", "llama", default_model_dir,
                                   hidden_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match=r"qkv_proj has 48 inputs per rank, not a multiple"):
        LLM(model=path, quantization="int8", num_gpu_blocks=16)


@pytest.mark.skipif(not cpu_int8.native_available(), reason="no native int8 kernel here")
def test_without_the_native_kernel_the_torch_path_scores_the_same(
        tiny_llama_dir, monkeypatch) -> None:
    """Weights kept plain (as on a CPU without AVX2) run ``cpu_int8.reference``: the same
    integers summed in another order. Rounding activations to int8 turns an ulp into a
    step now and then, so the paths are compared teacher-forced on the same sequences:
    the same top-1 token almost everywhere and logprobs within a hair."""
    prompts = prompts_of_mixed_lengths()
    scores = []
    for native in (True, False):
        monkeypatch.setattr(cpu_int8, "native_available", lambda n=native: n)
        llm = LLM(model=tiny_llama_dir, quantization="int8", num_gpu_blocks=256)
        try:
            proj = llm.engine.executor.worker.model.layers[0].mlp.down_proj
            assert proj.quant.packed is native
            if native:
                seqs = [p + o for p, o in zip(prompts, _tokens(
                    llm.generate(prompts, GREEDY, use_tqdm=False)))]
            scores.append(_scores(llm, seqs, 1))
        finally:
            llm.shutdown()
    kernel, torch_path = scores
    agree = sum(a[0] == b[0] for a, b in zip(kernel, torch_path)) / len(kernel)
    dlp = sum(abs(a[1] - b[1]) for a, b in zip(kernel, torch_path)) / len(kernel)
    print(f"kernel vs torch path: top-1 agreement {agree:.4f}, mean |dlogp| {dlp:.5f}")
    assert agree >= 0.97 and dlp < 0.02, (agree, dlp)


def test_mixture_of_experts_quantizes_every_projection_and_expert(
        tmp_path, default_model_dir) -> None:
    """Attention, the shared expert, the LM head and every routed expert take int8 (the
    expert stacks are dropped); the router stays in the model dtype; the answers are
    batch-invariant, follow the fp32 model's first tokens, and the weights shrink."""
    path = write_random_checkpoint(tmp_path / "moe", "qwen2_moe", default_model_dir,
                                   shared_expert_intermediate_size=64)
    prompts = prompts_of_mixed_lengths(12)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ref = LLM(model=path, num_gpu_blocks=256)
    try:
        ref_bytes = ref.engine.model_info["weight_bytes"]
        ref_toks = _tokens(ref.generate(prompts, params, use_tqdm=False))
    finally:
        ref.shutdown()
    llm = LLM(model=path, quantization="int8", num_gpu_blocks=256)
    try:
        model = llm.engine.executor.worker.model
        moe = model.layers[0].mlp
        assert moe.shared_gate_up.quant is not None and moe.shared_down.quant is not None
        assert model.layers[0].self_attn.o_proj.quant is not None
        assert model.lm_head.quant is not None
        stacked = moe.int8_native[0][0] if moe.int8_native else moe.int8  # kernel or loop
        assert len(stacked) == moe.num_experts and moe.w13.numel() == moe.w2.numel() == 0
        assert moe.router.dtype == torch.float32 and moe.router.numel() > 0
        embed = model.embed_tokens.weight  # kept in fp32 for the lookup
        embed_bytes = embed.numel() * embed.element_size()
        rest = llm.engine.model_info["weight_bytes"] - embed_bytes
        assert rest < 0.3 * (ref_bytes - embed_bytes)  # 1.125 bytes a weight, not 4
        batch = _tokens(llm.generate(prompts[:6], GREEDY, use_tqdm=False))
        assert batch == [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0]
                         for p in prompts[:6]]
        first = _tokens(llm.generate(prompts, params, use_tqdm=False))
        same = sum(a[0] == b[0] for a, b in zip(first, ref_toks))
        print(f"MoE first tokens equal to fp32: {same} of {len(prompts)}")
        assert same >= 0.6 * len(prompts)
    finally:
        llm.shutdown()


def test_embedding_model_quantizes_its_layers_not_the_unused_head(
        tmp_path, default_model_dir) -> None:
    """An embedding checkpoint (no LM head) under int8: every layer's projections take
    int8, the head it never runs is left alone, and the vectors stay close to fp32's."""
    path = write_random_checkpoint(tmp_path / "emb", "qwen3", default_model_dir,
                                   base_model=True, head_dim=32)
    texts = ["hello world", "paged attention keeps the KV cache in blocks"]
    vecs = {}
    for quant in (None, "int8"):
        llm = LLM(model=path, quantization=quant, num_gpu_blocks=64)
        try:
            model = llm.engine.executor.worker.model
            if quant:
                assert model.lm_head.quant is None
                assert all(layer.mlp.down_proj.quant is not None for layer in model.layers)
            vecs[quant] = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
        finally:
            llm.shutdown()
    cos = torch.nn.functional.cosine_similarity(vecs[None], vecs["int8"], dim=-1)
    assert bool((cos > 0.99).all()), cos


def test_engine_on_a_quantised_checkpoint_gives_the_dense_files_tokens(tiny_llama_dir,
                                                                       tmp_path) -> None:
    """Through ``LLM``: an AWQ file (its tokenizer beside it) gives the greedy tokens of
    the dense checkpoint it stands for, the stats name the format, and ``int4`` over it
    serves it (each prompt's first token is the dense run's); ``update_weights`` moves
    between the dense file and the AWQ one, awake and from level-2 sleep."""
    from pathlib import Path

    from pagedserve.worker.testing_prequant import write_awq

    qpath, dense = write_awq(Path(tiny_llama_dir), tmp_path / "awq")
    prompts = prompts_of_mixed_lengths()
    runs = {}
    for name, path, quant in (("dense", dense, None), ("awq", qpath, None),
                              ("awq_int4", qpath, "int4")):
        llm = LLM(model=str(path), quantization=quant, num_gpu_blocks=256)
        try:
            runs[name] = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
            memory = llm.engine.get_stats()["memory"]
            assert memory["checkpoint_quantization"] == (None if name == "dense" else "awq")
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()
    assert runs["awq"] == runs["dense"]
    # update_weights between the dense file and the quantised one, asleep or awake.
    llm = LLM(model=str(dense), num_gpu_blocks=256)
    try:
        for asleep, path, name in ((0, qpath, "awq"), (2, dense, None), (0, qpath, "awq")):
            if asleep:
                llm.sleep(asleep)
            llm.update_weights(str(path))
            if asleep:
                llm.wake_up()
            assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == runs["dense"]
            assert llm.engine.get_stats()["memory"]["checkpoint_quantization"] == name
    finally:
        llm.shutdown()
    # Greedy runs part once a near-tie flips (int8 activations), so compare first tokens.
    assert [x[0] for x in runs["awq_int4"]] == [y[0] for y in runs["dense"]]
