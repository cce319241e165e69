"""The engine on a CUDA device: Hugging Face parity, CUDA-graph decode, memory profiling, swap.

The ``gpu`` tests skip without CUDA; ``bash bench/gpu_check.sh`` runs them in a
GPU window. The default model's 98 MB GGUF does not travel to the GPU box, so
the models are random checkpoints written here with a word-level tokenizer made
on the spot: one shaped like SmolLM2-135M's layers (hidden 576, 9 query and 3
KV heads of 64, tied head) but 4 layers deep, and the tiny Llama of the CPU
tests. The first test runs the same parity check on CPU, so the fixtures and
the check itself are exercised by every CI run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.cuda_graph import DecodeGraphRunner
from pagedserve.worker.testing import SMOLLM2_135M, write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths


def cuda_only(fn: Callable[..., None]) -> Callable[..., None]:
    """Mark a test ``gpu`` and skip it without CUDA."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


SMOL_SHAPED = {**SMOLLM2_135M, "num_hidden_layers": 4, "max_position_embeddings": 2048}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Mixed lengths, one past several blocks and one past a Triton split (256 keys)."""
    return [*prompts_of_mixed_lengths(), [(7 * j) % 40000 + 100 for j in range(300)]]


@pytest.fixture(scope="module")
def smol_shaped_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("smol_shaped"), "llama", None,
                                   **SMOL_SHAPED)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_wordlevel"), "llama", None)


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """Shut every engine a test made and give its device memory back before the next."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.shutdown()
    made.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _graphs(llm: LLM) -> DecodeGraphRunner | None:
    """The local worker's decode-graph runner (None when graphs are off)."""
    return llm.engine.executor.worker.runner.graphs


def _greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
            ) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_smol_shaped_checkpoint_equals_hugging_face_on_cpu(smol_shaped_dir, engines) -> None:
    prompts = _prompts()
    llm = LLM(model=smol_shaped_dir, device="cpu", num_gpu_blocks=64)
    engines.append(llm)
    assert _greedy(llm, prompts) == hf_greedy(smol_shaped_dir, prompts, 16)
    text = llm.generate(prompts[0], GREEDY)[0].outputs[0].text
    assert text.split() == [f"t{i}" for i in _greedy(llm, prompts[:1])[0]]


@pytest.mark.parametrize(("kw", "step_tokens"), [
    (dict(max_num_batched_tokens=64), 64),
    (dict(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=200), 200),
    (dict(max_num_batched_tokens=2, enforce_eager=True), 5),
])
def test_worker_gets_the_step_size_and_seq_limit(tiny_dir, engines, kw, step_tokens) -> None:
    """What the CUDA profiling step and the graph runner are sized from (checked on CPU)."""
    llm = LLM(model=tiny_dir, device="cpu", num_gpu_blocks=16, max_num_seqs=5, **kw)
    engines.append(llm)
    wcfg = llm.engine.executor.worker.config
    assert wcfg.max_num_seqs == 5 and wcfg.max_num_batched_tokens == step_tokens
    assert wcfg.enable_cuda_graph is False  # never on CPU


@cuda_only
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_cuda_greedy_equals_hugging_face(smol_shaped_dir, engines, chunked: bool) -> None:
    prompts = _prompts()
    ref = hf_greedy(smol_shaped_dir, prompts, 16, device="cuda")
    kw = dict(max_num_batched_tokens=64, max_num_seqs=4) if chunked else {}
    llm = LLM(model=smol_shaped_dir, device="cuda", dtype="float32",
              attention_backend="triton", num_gpu_blocks=512, **kw)
    engines.append(llm)
    assert _greedy(llm, prompts) == ref
    hits = llm.engine.scheduler.kv.prefix_hits
    assert _greedy(llm, prompts) == ref  # full prompt blocks now come from the prefix cache
    assert llm.engine.scheduler.kv.prefix_hits > hits
    graphs = _graphs(llm)
    assert graphs is not None and graphs.graphs and not graphs.disabled


@cuda_only
def test_cuda_defaults_bf16_graphs_and_enforce_eager(smol_shaped_dir, engines) -> None:
    """Default settings on CUDA: bf16, the best backend, graphs; ``enforce_eager`` has none.

    Both runs prefill eagerly through the same kernels, so the first tokens are equal
    bit for bit; later bf16 tokens may legitimately part (graph batches are padded).
    """
    prompts = _prompts()
    llm = LLM(model=smol_shaped_dir, device="cuda", num_gpu_blocks=512)
    engines.append(llm)
    info = llm.engine.model_info
    assert info["dtype"] == "bfloat16" and info["attention_backend"] in ("flash", "triton")
    graphed = _greedy(llm, prompts)
    assert _graphs(llm) is not None and _graphs(llm).graphs
    eager_llm = LLM(model=smol_shaped_dir, device="cuda", num_gpu_blocks=512,
                    enforce_eager=True)
    engines.append(eager_llm)
    assert _graphs(eager_llm) is None
    eager = _greedy(eager_llm, prompts)
    assert [len(t) for t in graphed] == [16] * len(prompts)
    assert [t[0] for t in graphed] == [t[0] for t in eager]


@cuda_only
def test_gpu_memory_utilization_sizes_the_pool(smol_shaped_dir, engines) -> None:
    """The pool fills what the share leaves after weights and a max-size step, no more."""
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for share in (0.25, 0.125):
        llm = LLM(model=smol_shaped_dir, device="cuda", gpu_memory_utilization=share,
                  swap_space_bytes=0, enforce_eager=True)
        engines.append(llm)
        free = torch.cuda.mem_get_info()[0]
        used = total - free
        assert used <= share * total + 256 * 2**20, (share, used / total)
        assert used >= 0.8 * share * total, (share, used / total)
        blocks[share] = llm.engine.scheduler.memory_stats().num_gpu_blocks
        assert len(_greedy(llm, _prompts()[:2])[0]) == 16
        llm.shutdown()
        engines.remove(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 0.4 < blocks[0.125] / blocks[0.25] < 0.5 + 1e-9, blocks


@cuda_only
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_cuda_preemption_gives_the_same_tokens(tiny_dir, engines, mode: str) -> None:
    prompts = prompts_of_mixed_lengths()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(model=tiny_dir, device="cuda", dtype="float32", num_gpu_blocks=256)
    engines.append(roomy)
    ref = _greedy(roomy, prompts, params)
    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", num_gpu_blocks=12,
              preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0,
              max_num_batched_tokens=64)
    engines.append(llm)
    assert _greedy(llm, prompts, params) == ref
    assert llm.engine.scheduler.num_preemptions[mode] > 0
    assert_pool_at_baseline(llm)


@cuda_only
def test_cuda_seeded_parallel_sampling_is_reproducible(tiny_dir, engines) -> None:
    """Sample ``i`` of ``n`` draws from seed ``seed + i``, so the same call gives the same
    samples. On CUDA that holds for the same shapes only (``batch_invariant`` is CPU-only;
    cuBLAS may pick kernels by row count, and a prefix-cache hit prefills fewer rows), so
    the cache is off, and a request alone matches its sample's first token: the prefill that
    draws it has the same rows in both. (On an H200 with the cache on, the repeat differed
    in one sample from its fifth token: a neighbouring token id, a draw at a CDF boundary.)
    """
    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", num_gpu_blocks=128,
              enable_prefix_caching=False)
    engines.append(llm)
    prompt = [(13 * j) % 3000 + 50 for j in range(40)]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    samples = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert samples == [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert len({tuple(s) for s in samples}) == 3
    for i, s in enumerate(samples):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7 + i,
                                                      max_tokens=10, ignore_eos=True))[0]
        assert alone.outputs[0].token_ids[0] == s[0]
    assert_pool_at_baseline(llm)


@cuda_only
def test_cuda_speculative_decoding_equals_hugging_face(tiny_dir, engines) -> None:
    """Drafted rows on the GPU: varlen attention over paged context (Triton), logits at
    every position, no CUDA graph for those steps; plain decode steps still replay one.
    (The tiny random Llama falls into loops the n-gram lookup guesses: on CPU this
    check drafted 32 rows and accepted 25 of 70 guesses.)"""
    prompts = [*_prompts(), [(11 * j) % 50 + 200 for j in range(8)] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = hf_greedy(tiny_dir, prompts, 32, device="cuda")
    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", attention_backend="triton",
              num_gpu_blocks=512, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 4,
                                                      "prompt_lookup_min": 1})
    engines.append(llm)
    assert _greedy(llm, prompts, params) == ref
    assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert_pool_at_baseline(llm)


@cuda_only
def test_cuda_suffix_decoding_equals_hugging_face(tiny_dir, engines) -> None:
    """Suffix decoding on the GPU: the prompts asked twice, the second time guessed
    from the cached answers (rows of up to 24 guesses through varlen attention)."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = hf_greedy(tiny_dir, prompts, 32, device="cuda")
    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", attention_backend="triton",
              num_gpu_blocks=512, speculative_config={"method": "suffix"})
    engines.append(llm)
    assert _greedy(llm, prompts, params) == ref
    assert _greedy(llm, prompts, params) == ref
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_accepted_tokens"] > 31 * len(prompts) // 2, spec
    assert_pool_at_baseline(llm)


@cuda_only
def test_cuda_draft_model_equals_hugging_face(tiny_dir, engines) -> None:
    """A draft model on the GPU (its own pool, eager forwards beside the target's
    graphs): greedy tokens are HF's and a self-draft keeps nearly every guess;
    sampled rows draw from ``q`` on the device and verify by the rule."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = hf_greedy(tiny_dir, prompts, 32, device="cuda")
    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", num_gpu_blocks=512,
              speculative_config={"model": tiny_dir, "num_speculative_tokens": 4})
    engines.append(llm)
    assert _greedy(llm, prompts, params) == ref
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_accepted_tokens"] > 0.9 * spec["num_draft_tokens"] > 0, spec
    hot = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == 32 for o in llm.generate(prompts, hot))
    assert_pool_at_baseline(llm)



@cuda_only
def test_cuda_eagle_heads_equal_hugging_face(tiny_dir, engines, tmp_path) -> None:
    """EAGLE on the GPU reads the features a captured decode graph gives back, and a
    head that guesses right keeps them all; EAGLE-3 (every step eager: it keeps three
    layers' inputs) over a draft vocabulary changes no greedy token."""
    from pagedserve.worker.testing_eagle import write_guessing_pair, write_random_eagle

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = _prompts()
    target, head = write_guessing_pair(tmp_path / "pair", None, num_layers=2)
    llm = LLM(model=target, device="cuda", dtype="float32", num_gpu_blocks=512,
              speculative_config={"method": "eagle", "model": head,
                                  "num_speculative_tokens": 4})
    engines.append(llm)
    assert _graphs(llm) is not None
    assert _greedy(llm, prompts, params) == hf_greedy(target, prompts, 32, device="cuda")
    spec = llm.engine.get_stats()["spec_decode"]
    assert spec["num_accepted_tokens"] > 0.95 * spec["num_draft_tokens"] > 0, spec
    assert_pool_at_baseline(llm)
    e3 = write_random_eagle(tmp_path / "e3", tiny_dir, "eagle3", draft_vocab=4096,
                            aux_layers=[0, 1, 1])
    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", num_gpu_blocks=512,
              speculative_config={"method": "eagle3", "model": e3,
                                  "num_speculative_tokens": 3})
    engines.append(llm)
    assert _greedy(llm, prompts, params) == hf_greedy(tiny_dir, prompts, 32, device="cuda")
    assert llm.engine.get_stats()["spec_decode"]["num_drafts"] > 0
    assert_pool_at_baseline(llm)


def _write_lora_by_hand(base_dir: str, dest, targets: list[str], r: int, seed: int) -> str:
    """A PEFT-format adapter written without ``peft`` (the GPU box has no package index):
    ``adapter_config.json`` and ``adapter_model.safetensors`` with random A and B."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(base_dir)
    hd = cfg.hidden_size // cfg.num_attention_heads
    shapes = {"q_proj": (cfg.hidden_size, cfg.num_attention_heads * hd),
              "k_proj": (cfg.hidden_size, cfg.num_key_value_heads * hd),
              "v_proj": (cfg.hidden_size, cfg.num_key_value_heads * hd),
              "o_proj": (cfg.num_attention_heads * hd, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name in targets:
            fan_in, fan_out = shapes[name]
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g)
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets,
         "bias": "none"}))
    return str(dest)


def _merged_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                   device: str) -> list[list[int]]:
    """HF ``generate`` with the adapter merged into the weights (W + 2 B A)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        tensors = load_file(f"{adapter_dir}/adapter_model.safetensors")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, a in tensors.items():
                if ".lora_A." in key:
                    b = tensors[key.replace(".lora_A.", ".lora_B.")]
                    name = key.removeprefix("base_model.model.").replace(".lora_A", "")
                    params[name].add_(2.0 * (b @ a))  # lora_alpha / r = 2
    model.to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            y = model.generate(torch.tensor([ids], device=device), do_sample=False,
                               max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _check_lora_mixed_batch(tiny_dir: str, engines: list[LLM], tmp_path, device: str
                            ) -> LLM:
    from pagedserve.cluster import LoRARequest

    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    loras = [None,
             LoRARequest("a", 1, _write_lora_by_hand(tiny_dir, tmp_path / "a", all7, 8, 1)),
             LoRARequest("b", 2, _write_lora_by_hand(tiny_dir, tmp_path / "b",
                                                     ["q_proj", "v_proj"], 4, 2))]
    prompts = _prompts()
    refs = {lora: _merged_greedy(tiny_dir, lora.lora_path if lora else None, prompts, device)
            for lora in loras}
    assert refs[loras[1]] != refs[None] and refs[loras[2]] != refs[None]
    kw = dict(attention_backend="triton", num_gpu_blocks=512) if device == "cuda" else \
        dict(num_gpu_blocks=128)
    llm = LLM(model=tiny_dir, device=device, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, **kw)
    engines.append(llm)
    batch = [(p, lora) for p in prompts for lora in loras]
    outs = llm.generate([p for p, _ in batch], GREEDY, lora_request=[lo for _, lo in batch])
    assert [o.outputs[0].token_ids for o in outs] == [
        refs[lora][i] for i in range(len(prompts)) for lora in loras]
    assert _greedy(llm, prompts) == refs[None]
    assert_pool_at_baseline(llm)
    return llm


def test_lora_by_hand_equals_merged_weights_on_cpu(tiny_dir, engines, tmp_path) -> None:
    """The CUDA LoRA check below, on CPU: its adapter files and merged reference run in CI."""
    _check_lora_mixed_batch(tiny_dir, engines, tmp_path, "cpu")


@cuda_only
def test_cuda_lora_mixed_batch_equals_hugging_face_merged(tiny_dir, engines, tmp_path) -> None:
    """Adapters on the GPU: steps with LoRA rows run eagerly (their row runs vary), a
    step of base-model rows only still replays a decode graph. The reference merges
    each adapter into HF's weights, LoRA's own definition."""
    llm = _check_lora_mixed_batch(tiny_dir, engines, tmp_path, "cuda")
    graphs = _graphs(llm)
    assert graphs is not None and graphs.graphs and not graphs.disabled


@cuda_only
def test_cuda_fp8_kv_cache_holds_twice_the_bf16_blocks_and_swaps_exactly(
        smol_shaped_dir, tiny_dir, engines) -> None:
    """bf16 model, fp8 pool: the default backend is one that reads fp8 (not flash-attn),
    graphs capture over it, the same bytes hold 2x the blocks; and (fp32 tiny model, as
    the other preemption test) swap preemption gives the tokens of a roomy fp8 run."""
    budget = 64 << 20
    bf16 = LLM(model=smol_shaped_dir, device="cuda", kv_cache_memory_bytes=budget,
               swap_space_bytes=0)
    engines.append(bf16)
    fp8 = LLM(model=smol_shaped_dir, device="cuda", kv_cache_memory_bytes=budget,
              kv_cache_dtype="fp8", swap_space_bytes=0)
    engines.append(fp8)
    info = fp8.engine.model_info
    assert info["kv_cache_dtype"] == "fp8_e4m3" and info["attention_backend"] == "triton"
    blocks = [e.engine.scheduler.memory_stats().num_gpu_blocks for e in (bf16, fp8)]
    assert blocks[1] == 2 * blocks[0], blocks
    prompts = prompts_of_mixed_lengths()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _greedy(fp8, prompts, params)
    assert _graphs(fp8) is not None and _graphs(fp8).graphs
    assert [len(t) for t in ref] == [24] * len(prompts)
    tight = LLM(model=tiny_dir, device="cuda", dtype="float32", kv_cache_dtype="fp8",
                num_gpu_blocks=12, num_cpu_blocks=64, max_num_batched_tokens=64)
    engines.append(tight)
    roomy = LLM(model=tiny_dir, device="cuda", dtype="float32", kv_cache_dtype="fp8",
                num_gpu_blocks=256)
    engines.append(roomy)
    assert _greedy(tight, prompts, params) == _greedy(roomy, prompts, params)
    assert tight.engine.scheduler.num_preemptions["swap"] > 0
    assert_pool_at_baseline(tight)


@cuda_only
def test_cuda_kv_transfer_between_two_engines_equals_one_engine(smol_shaped_dir,
                                                                engines) -> None:
    """Disaggregated prefill on the GPU, decode in CUDA graphs: blocks read to the host on
    one engine, written back to the device on another, then hit there (fp32, so that
    the prefix-hit path and the whole-prompt path agree to the token)."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    prompts = _prompts()
    made = [LLM(model=smol_shaped_dir, device="cuda", dtype="float32", num_gpu_blocks=256)
            for _ in range(3)]
    engines.extend(made)
    prefill_llm, decode_llm, plain = made
    ref = _greedy(plain, prompts, GREEDY)
    payloads = prefill(prefill_llm, prompts)
    assert all(k.device.type == "cpu" for p in payloads for k, *_ in p.shards)
    assert sum(import_prompt_kv(decode_llm.engine, p) for p in payloads) > 0
    outs = decode_llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    B = decode_llm.engine.scheduler.block_size
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // B * B for p in prompts]
    for llm in made:
        assert_pool_at_baseline(llm)
