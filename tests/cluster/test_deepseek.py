"""DeepSeek-V2 / V3 through the engine: Hugging Face's greedy tokens under chunked
prefill, preemption, prefix hits, n-gram drafts, CPU offloading and shipped prompt
K/V; the latent cache's size; a V3 file's multi-token-prediction layers skipped;
clear refusals.

(Logits against HF's forward step by step, the routers against HF's, and TP=2 =
TP=1 are in ``tests/worker``.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# DeepSeek-V3's own RoPE in small: YaRN stretching a 64-token pre-trained length 4x,
# with the mscale pair that also scales every attention score.
V3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
           "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def _write(dest: Path, kind: str, tokenizer_dir: str, **kw) -> str:
    # (HF's MLA reads num_key_value_heads as the head count: it must equal the heads)
    return write_random_checkpoint(dest, kind, tokenizer_dir, num_key_value_heads=4,
                                   num_hidden_layers=3, max_position_embeddings=256, **kw)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return _write(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", default_model_dir,
                  rope_scaling=V3_YARN)


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return _write(tmp_path_factory.mktemp("deepseek_v2"), "deepseek_v2", default_model_dir)


@pytest.fixture(scope="module")
def refs(v3_dir: str, v2_dir: str) -> dict[str, list[list[int]]]:
    prompts = prompts_of_mixed_lengths()
    return {"v3": hf_greedy(v3_dir, prompts, 16), "v2": hf_greedy(v2_dir, prompts, 16)}


@pytest.mark.parametrize("kind,mode", [("v3", "swap"), ("v2", "recompute")])
def test_chunked_prefill_and_preemption_equal_hugging_face(kind, mode, v3_dir, v2_dir,
                                                           refs) -> None:
    """Prompts of 3-48 tokens in chunks of 8 over a pool of 24 four-token blocks: steps
    mix prompt chunks and decodes, sequences are preempted and come back."""
    path = v3_dir if kind == "v3" else v2_dir
    llm = LLM(model=path, block_size=4, num_gpu_blocks=24, preemption_mode=mode,
              num_cpu_blocks=64 if mode == "swap" else 0, max_num_batched_tokens=8)
    try:
        outs = llm.generate(prompts_of_mixed_lengths(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs[kind]
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_prefix_hits_and_ngram_drafts_equal_hugging_face(v3_dir, refs) -> None:
    """The prompts twice: the second time each reuses its cached latent blocks, and
    n-gram drafts verified in one step keep HF's tokens."""
    prompts = prompts_of_mixed_lengths()
    llm = LLM(model=v3_dir, block_size=4, num_gpu_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        first = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)
        for outs in (first, again):
            assert [o.outputs[0].token_ids for o in outs] == refs["v3"]
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts]
    finally:
        llm.shutdown()


def test_offloaded_latent_blocks_come_back_as_hugging_face(v3_dir, refs) -> None:
    """A pool of 24 blocks under prompts that need more: evicted prefixes go to the CPU
    tier, the second pass loads them back, and the tokens stay HF's."""
    llm = LLM(model=v3_dir, block_size=4, num_gpu_blocks=24, num_offload_blocks=128)
    try:
        for _ in range(2):
            outs = llm.generate(prompts_of_mixed_lengths(), GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == refs["v3"]
        off = llm.engine.get_stats()["kv_offload"]
        assert off["offloaded_blocks"] > 0 and off["loaded_blocks"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_narrow_latent_caches(v3_dir, refs) -> None:
    """A bf16 latent pool under the fp32 model keeps HF's tokens; an fp8 one (which
    moves them: E4M3 keeps 3 mantissa bits) gives the same tokens whether prompt
    chunks read it back through rebuilt keys (widened) or in the latent."""
    prompts = prompts_of_mixed_lengths()
    got = {}
    for dtype, above in (("bfloat16", None), ("fp8", None), ("fp8", math.inf)):
        llm = LLM(model=v3_dir, block_size=4, num_gpu_blocks=128, kv_cache_dtype=dtype)
        try:
            worker = llm.engine.executor.worker
            assert worker.kv_cache.key_caches[0].element_size() < 4
            for layer in worker.model.layers if above else ():
                layer.self_attn.decompress_above = above
            got[dtype, above] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()
    assert got["bfloat16", None] == refs["v3"]
    assert got["fp8", None] == got["fp8", math.inf]


def test_the_latent_cache_is_one_vector_a_token(v3_dir) -> None:
    """A block holds, per layer, one 64-number latent a token (56 compressed + 8
    rotated), serving as key and value: a byte budget buys blocks at that price, half
    what a separate value cache would take, and 2.5x fewer bytes than a plain cache of
    the model's 4 heads of 24 (keys) and 16 (values) would (DeepSeek-V3's 128 heads
    of 192 and 128 against 576 numbers: 71x)."""
    layers, block, latent = 3, 4, 56 + 8
    budget = 1 << 20
    llm = LLM(model=v3_dir, block_size=block, kv_cache_memory_bytes=budget)
    try:
        kv = llm.engine.executor.worker.kv_cache
        assert kv.value_caches is kv.key_caches
        assert tuple(kv.key_caches[0].shape[1:]) == (block, 1, latent)
        per_block = layers * block * latent * 4
        assert llm.engine.scheduler.kv.pool.num_blocks == budget // per_block
        plain = layers * block * 4 * (24 + 16) * 4
        assert plain / per_block == 2.5
    finally:
        llm.shutdown()


def test_shipped_prompt_kv_decodes_as_hugging_face(v2_dir, refs) -> None:
    """Disaggregated prefill: one engine's latent blocks written into another, which
    then answers as HF having computed only each prompt's last partial block."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    prompts = prompts_of_mixed_lengths()
    made = [LLM(model=v2_dir, num_gpu_blocks=128, block_size=4) for _ in range(2)]
    try:
        for payload in prefill(made[0], prompts):
            # The latent once a token and layer (values are the keys: not shipped again).
            assert payload.nbytes == payload.num_tokens * 3 * (56 + 8) * 4
            import_prompt_kv(made[1].engine, payload)
        outs = made[1].generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs["v2"]
        assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    finally:
        for llm in made:
            llm.shutdown()


def test_multi_token_prediction_layers_are_skipped(tmp_path, v3_dir, refs) -> None:
    """A released V3 file also holds its MTP module as layer ``num_hidden_layers``
    (``num_nextn_predict_layers``); the decoder loads around it."""
    dest = tmp_path / "with_mtp"
    dest.mkdir()
    for f in Path(v3_dir).iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dest / "model.safetensors")
    mtp = {f"model.layers.3.{n}": torch.randn(8, 8)
           for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                     "shared_head.head.weight", "self_attn.kv_b_proj.weight")}
    save_file({**tensors, **mtp}, dest / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=str(dest), num_gpu_blocks=128, block_size=4)
    try:
        outs = llm.generate(prompts_of_mixed_lengths()[:3], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs["v3"][:3]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw,match", [
    (dict(enable_lora=True, max_lora_rank=8), "enable_lora"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True), "calculate_kv_scales"),
    (dict(attention_backend="flash"), "flash|unavailable"),
])
def test_what_latent_attention_does_not_serve_is_refused(v2_dir, kw, match) -> None:
    with pytest.raises((ValueError, RuntimeError), match=match):
        LLM(model=v2_dir, num_gpu_blocks=16, **kw)


@pytest.mark.parametrize("field,value,match", [
    ("kv_lora_rank", 0, "kv_lora_rank"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("topk_method", "noaux_tc", "topk_method"),
    ("n_group", 3, "n_group"),
    ("attention_bias", True, "attention_bias"),
])
def test_bad_deepseek_config_names_its_field(tmp_path, v2_dir, field, value, match) -> None:
    dest = tmp_path / "bad"
    dest.mkdir()
    for f in Path(v2_dir).iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dest / "config.json").read_text())
    cfg[field] = value
    (dest / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(dest), num_gpu_blocks=16)
