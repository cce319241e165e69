"""GLM-4.5 / 4.6 (``glm4_moe``) through the engine: Hugging Face's greedy tokens under
chunked prefill (GQA with biased q/k/v and no ``o_proj`` bias, per-head q/k norms, RoPE
on half of each head, DeepSeek-V3's grouped, biased, shared-expert routing), the
file's multi-token-prediction layer never read, and the config flags as transformers
reads them. (TP=2 is in ``tests/worker/test_tensor_parallel.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory, default_model_dir) -> str:
    """A random GLM-4.5 whose file also holds an MTP layer (``model.layers.2.*``, which
    transformers' class does not build), as the releases do."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe",
                                   default_model_dir, num_nextn_predict_layers=1)
    f = Path(path) / "model.safetensors"
    tensors = load_file(f)
    tensors |= {"model.layers.2.eh_proj.weight": torch.zeros(64, 128),
                "model.layers.2.enorm.weight": torch.ones(64),
                "model.layers.2.mlp.gate.weight": torch.zeros(8, 64)}
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def test_greedy_equals_hugging_face(glm_dir) -> None:
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(glm_dir, prompts, 12)
    llm = LLM(model=glm_dir, num_gpu_blocks=128, block_size=4, max_num_batched_tokens=8)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
        model = llm.engine.executor.worker.model
        assert len(model.layers) == 2 and model.layers[0].self_attn.o_proj.bias is None
    finally:
        llm.shutdown()


def test_config_flags_follow_transformers(glm_dir) -> None:
    cfg = json.loads((Path(glm_dir) / "config.json").read_text())
    mc = ModelConfig.from_hf_dict(cfg)
    assert mc.qkv_bias and not mc.o_bias and mc.qk_norm
    assert mc.rotary_dim == 8 and mc.moe.sparse_layers == (1,) and mc.moe.score_bias
    assert mc.moe.routed_scale == 2.5 and mc.moe.shared_intermediate_size == 32
    plain = ModelConfig.from_hf_dict({**cfg, "use_qk_norm": False, "attention_bias": False})
    assert not plain.qk_norm and not plain.qkv_bias
