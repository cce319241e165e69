"""Engine test fixtures: small random checkpoints written with ``save_pretrained``
(loaded back through the real loader) and Hugging Face references."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from pagedserve.worker.loaders import resolve_model

    return resolve_model(None).path


def _write_random_model(dest: Path, kind: str, tokenizer_dir: str, **overrides: object) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():  # sharper logits than the default init: fewer argmax near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, dest / name)
    return str(dest)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return _write_random_model(tmp_path_factory.mktemp("tiny_llama"), "llama",
                               default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return _write_random_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2",
                               default_model_dir, tie_word_embeddings=True)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              ignore_eos: bool = True) -> list[list[int]]:
    """Hugging Face ``generate`` (greedy, one prompt at a time: no padding effects)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens if ignore_eos else 0,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def smol_llm(default_model_dir: str) -> Iterator[object]:
    """The default model in one shared engine (loading it is the slow part)."""
    from pagedserve.cluster import LLM

    llm = LLM(num_gpu_blocks=256, max_num_seqs=32)
    yield llm
    llm.shutdown()
