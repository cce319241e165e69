"""The newer model paths through the engine on CUDA (Triton attention, decode in CUDA
graphs) against Hugging Face on the same device: a Mistral whose every layer slides
(blocks released behind the window), a Gemma 3 (sliding and global layers, two RoPE
tables, head size 256), a Gemma 2 (softcapped scores in the Triton kernel), a
LongRoPE Phi-3 (recomputed at the switch) and a DeepSeek-V3 (latent attention over a
576-wide cache, grouped routing).

Each case also runs on CPU, so every CI run exercises the fixtures and the check; the
``cuda`` cases are ``gpu`` tests for ``bash bench/gpu_check.sh``. Tokenizers are made
on the spot (the default model's files need not be on the GPU box).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _longrope() -> dict:
    g = random.Random(5)
    return {"max_position_embeddings": 512, "original_max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "longrope",
                             "short_factor": [round(1 + g.random(), 3) for _ in range(8)],
                             "long_factor": [round(2 + 6 * g.random(), 3) for _ in range(8)]}}


CASES = {
    "mistral_window": ("mistral", dict(sliding_window=40, max_position_embeddings=1024)),
    "gemma3": ("gemma3_text", dict(head_dim=256, query_pre_attn_scalar=64, sliding_window=48,
                                   num_hidden_layers=3, max_position_embeddings=1024,
                                   layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention"])),
    "phi3_longrope": ("phi3", dict(pad_token_id=0, **_longrope())),
    "gemma2_softcap": ("gemma2", dict(head_dim=256, query_pre_attn_scalar=64, sliding_window=48,
                                      num_hidden_layers=3, attn_logit_softcapping=1.0,
                                      final_logit_softcapping=6.0,
                                      max_position_embeddings=1024)),
    # DeepSeek-V3's own latent width: 512 compressed + 64 rotated numbers a token, one
    # "head" of 576 (Triton pads it to 1024 lanes), routed experts in groups.
    "deepseek_v3_mla": ("deepseek_v3", dict(num_key_value_heads=4, kv_lora_rank=512,
                                            qk_rope_head_dim=64, num_hidden_layers=3,
                                            max_position_embeddings=1024)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    kind, kw = CASES[request.param]
    return write_random_checkpoint(tmp_path_factory.mktemp(request.param), kind, None, **kw)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_model_equals_hugging_face(model_dir: str, device: str) -> None:
    """Mixed prompts and one of 300 tokens (past every window and the LongRoPE length),
    then the same prompts again as prefix-cache hits; Gemma's layers in KV cache groups."""
    prompts = [*prompts_of_mixed_lengths(), [(7 * j) % 40000 + 100 for j in range(300)]]
    ref = hf_greedy(model_dir, prompts, 20, device=device)
    kw = dict(attention_backend="triton") if device == "cuda" else {}
    llm = LLM(model=model_dir, device=device, dtype="float32", num_gpu_blocks=256,
              block_size=16, **kw)
    try:
        if "gemma" in model_dir:  # a table per KV cache group: S, F, S layers
            assert len(llm.engine.scheduler.kv.group_windows) == 3
        for _ in range(2):
            outs = llm.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == ref
        if device == "cuda":
            graphs = llm.engine.executor.worker.runner.graphs
            assert graphs is not None and graphs.graphs and not graphs.disabled
    finally:
        llm.shutdown()
