"""Engine test fixtures: small random checkpoints written with ``save_pretrained``
(loaded back through the real loader) and Hugging Face references."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pagedserve.worker.testing import write_random_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from pagedserve.worker.loaders import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama",
                                   default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2",
                                   default_model_dir, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_yarn_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Qwen3 (per-head q/k norms) with YaRN over a 32-position "pre-training" length,
    so most positions in a test are stretched ones."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", default_model_dir, head_dim=32,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Mixtral: 4 experts, top 2 (renormalised), every layer routed."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral",
                                   default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Qwen2-MoE: q/k/v bias, 4 experts top 2 (not renormalised) plus a gated shared expert."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_qwen2_moe"), "qwen2_moe",
                                   default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Qwen3-MoE: q/k norms, 8 experts top 3, layer 1 a dense MLP (``mlp_only_layers``)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe",
                                   default_model_dir, num_experts=8, num_experts_per_tok=3,
                                   mlp_only_layers=[1])


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Gemma 3: two sliding layers (8-token window, local RoPE base) around a global
    one (linear x4 RoPE), query_pre_attn_scalar 24 over head size 16."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tiny_gemma3"), "gemma3_text", default_model_dir,
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling=dict(rope_type="linear", factor=4.0))


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Gemma 2: layers 0 and 2 slide over 8 tokens, attention scores capped at 1.0 (most
    of them pass it) and logits at 6.0."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tiny_gemma2"), "gemma2", default_model_dir,
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=1.0, final_logit_softcapping=6.0)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Phi-3 / Phi-4: fused qkv_proj and gate_up_proj in the file, a 12-token window."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_phi3"), "phi3",
                                   default_model_dir, sliding_window=12)


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """GPT-OSS: attention sinks, biased experts with a clamped SwiGLU, YaRN, and sliding
    (12-token) and full layers alternating."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_gpt_oss"), "gpt_oss",
                                   default_model_dir)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Granite 3.x: a tied head and four scalars away from 1 (``GRANITE_SCALES``)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_granite"), "granite",
                                   default_model_dir, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_granitemoe_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Granite MoE with its shared expert: stacked experts, Granite's scalars."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_granitemoe"),
                                   "granitemoeshared", default_model_dir)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              ignore_eos: bool = True, device: str = "cpu",
              processors: Callable[[int], list[Any]] | None = None,
              **generate_kwargs: Any) -> list[list[int]]:
    """Hugging Face ``generate`` (greedy, one prompt at a time: no padding effects).

    ``processors(prompt_len)`` gives extra logits processors per prompt.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens if ignore_eos else 0,
                               pad_token_id=0,
                               logits_processor=processors(len(ids)) if processors else None,
                               **generate_kwargs)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def smol_llm(default_model_dir: str) -> Iterator[object]:
    """The default model in one shared engine (loading it is the slow part)."""
    from pagedserve.cluster import LLM

    llm = LLM(num_gpu_blocks=256, max_num_seqs=32)
    yield llm
    llm.shutdown()


# The LoRA session fixtures, shared by every module of the package that uses them.
from tests.cluster.lora_fixtures import llama_loras, llama_refs  # noqa: E402, F401
