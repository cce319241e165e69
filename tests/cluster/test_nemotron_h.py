"""Nemotron-H (``nemotron_h``): Mamba-2, attention and squared-ReLU MLP blocks.

A 6-block model (``M-*-M-``: two Mamba-2 blocks, one attention block, three MLP
blocks; two B / C groups, 8-token scan chunks), saved by transformers under the
files' ``backbone.`` names, gives transformers' greedy tokens through the engine,
each prompt twice in a batch and under 8-token prefill chunks; the KV pool holds
the attention block alone. So does Nemotron 3's shape, with routed-expert blocks
(squared-ReLU experts, DeepSeek-V3's routing, a shared expert). Experts behind a
latent projection, groups that do not split the experts, an unknown block letter
and another MLP activation are named. (What hybrids share, slots and
refusals, is tested on Granite 4.0-H: ``test_granite_hybrid.py``; TP=2 in
``tests/worker/test_tensor_parallel.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, default_model_dir) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("nemotron_h"), "nemotron_h",
                                   default_model_dir)


def test_greedy_equals_hugging_face_whole_and_in_prefill_chunks(nemotron) -> None:
    from safetensors import safe_open

    with safe_open(str(Path(nemotron) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "backbone.norm_f.weight" in names  # (the files' own names)
    prompts = prompts_of_mixed_lengths(5)
    ref = hf_greedy(nemotron, prompts, GREEDY.max_tokens)
    llm = LLM(model=nemotron, num_gpu_blocks=96, block_size=4)
    try:
        assert llm.engine.executor.worker.kv_cache.layer_slots == [0]  # (one attention block)
        outs = llm.generate(prompts + prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref + ref
    finally:
        llm.shutdown()
    llm = LLM(model=nemotron, num_gpu_blocks=96, block_size=4, max_num_batched_tokens=8)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    finally:
        llm.shutdown()


# Nemotron 3's shape: routed-expert blocks (8 experts in 4 groups, top 2 from the best 2
# groups, scaled by 2.5) with a shared expert, between Mamba, attention and MLP blocks.
NEMOTRON3 = dict(hybrid_override_pattern="ME*EM-", n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=4,
                 topk_group=2, routed_scaling_factor=2.5)


def test_nemotron3_experts_equal_hugging_face_whole_and_in_prefill_chunks(
        tmp_path, default_model_dir) -> None:
    path = write_random_checkpoint(tmp_path / "nemotron3", "nemotron_h", default_model_dir,
                                   **NEMOTRON3)
    mc = ModelConfig.from_pretrained(path)
    assert mc.moe.sparse_layers == (1, 3) and mc.moe.shared_intermediate_size == 48
    prompts = prompts_of_mixed_lengths(5)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    for chunks in ({}, {"max_num_batched_tokens": 8}):
        llm = LLM(model=path, num_gpu_blocks=96, block_size=4, **chunks)
        try:
            outs = llm.generate(prompts + prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == ref + ref
        finally:
            llm.shutdown()


@pytest.mark.parametrize("fields,match", [
    ({"hybrid_override_pattern": "M-*E", "moe_latent_size": 64}, "moe_latent_size"),
    ({"hybrid_override_pattern": "M-*E", "n_group": 3}, "'n_group' \\(3\\)"),
    ({"hybrid_override_pattern": "M-X"}, "hybrid_override_pattern"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"n_groups": 3}, "n_groups"),
])
def test_bad_fields_are_named(nemotron, fields, match) -> None:
    cfg = {**json.loads((Path(nemotron) / "config.json").read_text()), **fields}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)
