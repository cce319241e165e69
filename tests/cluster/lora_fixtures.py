"""LoRA test helpers shared by the engine, TP, fuzz and GPU tests: PEFT adapters for
the tiny Llama, Hugging Face + PEFT references, mixed batches, and the session
fixtures ``llama_loras`` / ``llama_refs`` (registered for the package in conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.cluster import LoRARequest, SamplingParams
from pagedserve.worker.testing import write_random_lora
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
