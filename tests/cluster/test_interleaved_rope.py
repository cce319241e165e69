"""Models whose RoPE turns interleaved pairs, which the loader reorders into our
half-split rotation: Ernie 4.5 (``ernie4_5``; and its MoE, ``ernie4_5_moe``: softmax
routing with a bias on the choosing scores, shared experts) and GLM-4 (``glm4``: on
half of each head, with four norms a layer and a fused gate/up). The engine gives Hugging Face's
greedy tokens under chunked prefill, while an Ernie file read as a plain Llama (no
reordering) does not; biased MLPs are refused by name. (TP=2, each head reordered
before it is split, is in ``tests/worker/test_tensor_parallel.py``.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, default_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("interleaved")
    return {"ernie4_5": write_random_checkpoint(root / "ernie", "ernie4_5", default_model_dir,
                                                head_dim=16, tie_word_embeddings=True),
            "glm4": write_random_checkpoint(root / "glm4", "glm4", default_model_dir,
                                            head_dim=16),
            "ernie4_5_moe": write_random_checkpoint(root / "ernie_moe", "ernie4_5_moe",
                                                    default_model_dir,
                                                    tie_word_embeddings=True)}


def _greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4, max_num_batched_tokens=8)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["ernie4_5", "glm4", "ernie4_5_moe"])
def test_interleaved_rope_equals_hugging_face(tmp_path, dirs, kind) -> None:
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(dirs[kind], prompts, 12)
    assert _greedy(dirs[kind], prompts) == ref
    if kind == "ernie4_5":  # the pairs' order matters: unreordered, other tokens
        as_llama = tmp_path / "as_llama"
        shutil.copytree(dirs[kind], as_llama)
        cfg = json.loads((as_llama / "config.json").read_text())
        (as_llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
        assert _greedy(str(as_llama), prompts) != ref


def test_config_flags(dirs) -> None:
    ernie = json.loads((Path(dirs["ernie4_5"]) / "config.json").read_text())
    assert ModelConfig.from_hf_dict(ernie).rope_interleaved
    with pytest.raises(ValueError, match="use_bias"):
        ModelConfig.from_hf_dict({**ernie, "use_bias": True})
    moe = ModelConfig.from_pretrained(dirs["ernie4_5_moe"]).moe
    assert moe.sparse_layers == (1,) and moe.score_bias and moe.shared_intermediate_size == 64
    assert moe.num_experts == 8 and moe.top_k == 2 and moe.renormalize
    glm = ModelConfig.from_pretrained(dirs["glm4"])
    assert glm.rope_interleaved and glm.rotary_dim == 8 and glm.qkv_bias and not glm.o_bias
