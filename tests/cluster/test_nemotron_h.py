"""Nemotron-H (``nemotron_h``): Mamba-2, attention and squared-ReLU MLP blocks.

A 6-block model (``M-*-M-``: two Mamba-2 blocks, one attention block, three MLP
blocks; two B / C groups, 8-token scan chunks), saved by transformers under the
files' ``backbone.`` names, gives transformers' greedy tokens through the engine,
each prompt twice in a batch and under 8-token prefill chunks; the KV pool holds
the attention block alone. A pattern with routed-expert blocks, an unknown block
letter and another MLP activation are named. (What hybrids share, slots and
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


@pytest.mark.parametrize("field,value,match", [
    ("hybrid_override_pattern", "M-*E", "routed-expert"),
    ("hybrid_override_pattern", "M-X", "hybrid_override_pattern"),
    ("mlp_hidden_act", "silu", "mlp_hidden_act"),
    ("n_groups", 3, "n_groups"),
])
def test_bad_fields_are_named(nemotron, field, value, match) -> None:
    cfg = json.loads((Path(nemotron) / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)
