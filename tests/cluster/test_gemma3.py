"""Gemma 3 text models through the engine: greedy tokens equal Hugging Face's (and
HF + PEFT's under a LoRA adapter) on a random checkpoint whose sliding layers have
their own RoPE base and an 8-token window, in chunks, as prefix-cache hits and with
n-gram drafts; int8 weights keep most first tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from tests.cluster.conftest import hf_greedy
from tests.cluster.lora_fixtures import ALL7, hf_peft_greedy, write_adapter
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_ref(tiny_gemma3_dir: str) -> list[list[int]]:
    return hf_greedy(tiny_gemma3_dir, prompts_of_mixed_lengths(), 24)


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=8, max_num_seqs=4),
                                dict(speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 3}),
                                dict(attention_backend="torch")],
                         ids=["chunked", "ngram", "torch-backend"])
def test_gemma3_equals_hugging_face(tiny_gemma3_dir, gemma_ref, kw: dict) -> None:
    llm = LLM(model=tiny_gemma3_dir, num_gpu_blocks=128, **kw)
    try:
        prompts = prompts_of_mixed_lengths()
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == gemma_ref
        again = llm.generate(prompts, GREEDY)  # prefix-cache hits
        assert [o.outputs[0].token_ids for o in again] == gemma_ref
        assert max(o.num_cached_tokens for o in again) >= 16
        info = llm.engine.model_info
        assert info["model_type"] == "gemma3_text" and info["kv_sliding_window"] is None
    finally:
        llm.shutdown()


def test_gemma3_lora_equals_hf_peft(tiny_gemma3_dir, tmp_path) -> None:
    """An adapter on all seven projections; its rows beside base-model rows."""
    adapter = write_adapter(tiny_gemma3_dir, tmp_path / "g_all7", 5, ALL7)
    prompts = prompts_of_mixed_lengths(4)
    ref = hf_peft_greedy(tiny_gemma3_dir, adapter, prompts)
    base = hf_peft_greedy(tiny_gemma3_dir, None, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=tiny_gemma3_dir, num_gpu_blocks=128, enable_lora=True, max_lora_rank=8)
    try:
        lora = LoRARequest("g_all7", 1, adapter)
        outs = llm.generate(prompts + prompts, params,
                            lora_request=[lora] * len(prompts) + [None] * len(prompts))
        assert [o.outputs[0].token_ids for o in outs] == ref + base
        assert ref != base
    finally:
        llm.shutdown()


def test_gemma3_int8_weights_follow_the_float_model(tiny_gemma3_dir) -> None:
    """int8 weights and activations (CPU): the first greedy token of most prompts is the
    fp32 model's, as for Llama (``test_quantization``): it perturbs, it does not scramble."""
    prompts = prompts_of_mixed_lengths(12)
    firsts = []
    for quant in (None, "int8"):
        llm = LLM(model=tiny_gemma3_dir, num_gpu_blocks=256, quantization=quant)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
            firsts.append([o.outputs[0].token_ids[0] for o in outs])
        finally:
            llm.shutdown()
    same = sum(a == b for a, b in zip(*firsts, strict=True))
    assert same >= 0.6 * len(prompts), (same, len(prompts))


@pytest.fixture(scope="module")
def multimodal_gemma3_dir(tmp_path_factory: pytest.TempPathFactory,
                          default_model_dir: str) -> str:
    """A random Gemma3ForConditionalGeneration (tiny SigLIP tower) saved by transformers,
    with a text_config that lists only some fields, as the released files do."""
    import json
    import shutil

    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from pagedserve.worker.testing import TOKENIZER_FILES

    text = dict(vocab_size=4200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2,
                rope_scaling=dict(rope_type="linear", factor=4.0))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(3)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=4199, boi_token_index=4197, eoi_token_index=4198))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() >= 2 else p.normal_(0.0, 0.5)
    dest = tmp_path_factory.mktemp("gemma3_mm")
    model.save_pretrained(dest)
    cfg_path = dest / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"] = {"model_type": "gemma3_text", **{k: cfg["text_config"][k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
        "sliding_window")}, "sliding_window_pattern": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    cfg_path.write_text(json.dumps(cfg))
    for name in TOKENIZER_FILES:
        if (Path(default_model_dir) / name).exists():
            shutil.copy(Path(default_model_dir) / name, dest / name)
    return str(dest)


def test_a_multimodal_gemma3_file_serves_its_text_decoder(multimodal_gemma3_dir) -> None:
    """Text prompts to a 4B-27B-style file (model_type gemma3, the decoder under
    ``language_model.``, a vision tower beside it, SigLIP's pooling head included) get
    Hugging Face's ``Gemma3ForConditionalGeneration`` tokens, with the image encoder
    loaded (the default) or not (``limit_mm_per_prompt={"image": 0}``)."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(multimodal_gemma3_dir, prompts, 24)
    for images in (None, {"image": 0}):
        llm = LLM(model=multimodal_gemma3_dir, num_gpu_blocks=128, limit_mm_per_prompt=images)
        try:
            outs = llm.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == ref
            assert llm.engine.model_info["model_type"] == "gemma3_text"
            assert (llm.engine.images is None) == (images is not None)
            assert (llm.engine.model_info["image"] is None) == (images is not None)
        finally:
            llm.shutdown()
