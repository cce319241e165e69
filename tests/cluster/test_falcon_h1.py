"""TII's Falcon-H1 (``falcon_h1``): a Mamba-2 mixer beside the attention in every
layer, muP multipliers everywhere.

Through the engine, against Hugging Face's ``generate`` (its torch Mamba path) on files
its own classes wrote with every multiplier away from 1: greedy tokens equal over
prompts that span several scan chunks, each twice in a batch (and in 8-token prefill
chunks mixed with decodes, once), for the mixer's three output forms (the gated norm after
the gate, before it, none) with tied embeddings and biased projections; malformed
fields are named. TP=2 (``tests/worker/test_tensor_parallel.py``), pipeline stages
(``tests/worker/test_pipeline_stages.py``) and speculative decoding
(``test_hybrid_spec_decode.py``) cover it with the other hybrids."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.falcon_h1_config import falcon_h1_mamba_config, falcon_h1_multipliers
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("form,extra", [
    ("gate_then_norm", {}),
    ("gate_only", {"mamba_rms_norm": False}),
    ("norm_then_gate", {"mamba_norm_before_gate": True, "tie_word_embeddings": True,
                        "attention_bias": True, "mamba_proj_bias": True,
                        "projectors_bias": True}),
])
def test_greedy_equals_hugging_face_whole_and_in_prefill_chunks(form, extra, tmp_path,
                                                                default_model_dir) -> None:
    path = write_random_checkpoint(tmp_path / form, "falcon_h1", default_model_dir, **extra)
    prompts = prompts_of_mixed_lengths(6)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    mc = ModelConfig.from_pretrained(path)
    assert mc.mamba.gate_norm == form and mc.mamba.layers == mc.mamba.attention == (0, 1, 2)
    assert mc.falcon_h1.ssm == (1.1, 0.9, 1.2, 0.8, 1.3) and mc.nope_layers == ()
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4)
    try:
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
    finally:
        llm.shutdown()
    if form != "gate_then_norm":  # (prefill chunks: once is enough)
        return
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4, max_num_batched_tokens=8)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
    finally:
        llm.shutdown()


def test_malformed_fields_are_named() -> None:
    base = {"hidden_size": 64, "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8}
    with pytest.raises(ValueError, match="'mamba_d_head'"):
        falcon_h1_mamba_config({**base, "mamba_d_head": 16}, 2)
    with pytest.raises(ValueError, match="'projectors_bias' must agree"):
        falcon_h1_mamba_config({**base, "projectors_bias": True}, 2)
    with pytest.raises(ValueError, match="'ssm_multipliers' must be 5 numbers"):
        falcon_h1_multipliers({"ssm_multipliers": [1.0, 2.0]})
    with pytest.raises(ValueError, match="'key_multiplier' must be a number"):
        falcon_h1_multipliers({"key_multiplier": "big"})
