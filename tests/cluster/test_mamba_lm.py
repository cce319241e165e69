"""Attention-free Mamba models (``mamba``, ``falcon_mamba``: Mamba-1 blocks; ``mamba2``:
Mamba-2 blocks): no layer holds KV.

Through the engine, against Hugging Face's ``generate`` (its torch paths) on files its
own classes wrote: greedy tokens equal over prompts of 3 to 48 tokens, each twice in a
batch, for each family; one also in 8-token prefill chunks, and continued from
prefix-cache snapshots (the pool's blocks hold no bytes, only the scheduler's count of
each sequence's tokens and where its snapshots sit). KV offloading is refused, and
malformed fields are named. TP=2 (``tests/worker/test_tensor_parallel.py``),
pipeline stages (``tests/worker/test_pipeline_stages.py``) and rolled-back guesses
(``test_hybrid_spec_decode.py``) cover them with the hybrids."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.worker.mamba_lm_config import mamba_lm_config
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba", "mamba2"])
def test_greedy_equals_hugging_face_without_any_kv(kind, tmp_path, default_model_dir) -> None:
    path = write_random_checkpoint(tmp_path / kind, kind, default_model_dir)
    prompts = prompts_of_mixed_lengths(6)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(model=path, block_size=4, mamba_cache_mode="align" if kind == "mamba" else "none")
    try:
        worker = llm.engine.executor.worker
        assert worker.block_bytes() == 0 and not worker.model.attention_layers()
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
        if kind != "mamba":
            return
        turn2 = [p + o + [7, 8, 9] for p, o in zip(prompts, ref, strict=True)]
        cont = llm.generate(turn2, GREEDY)  # (from the first round's last snapshots)
        assert [o.num_cached_tokens for o in cont] == [
            (len(p) + len(o) - 1) // 4 * 4 for p, o in zip(prompts, ref, strict=True)]
    finally:
        llm.shutdown()
    assert _tokens(cont) == hf_greedy(path, turn2, GREEDY.max_tokens)
    llm = LLM(model=path, block_size=4, max_num_batched_tokens=8)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="kv_offloading_size is not supported for recurrent"):
        LLM(model=path, kv_offloading_size=1)
    assert EngineConfig(model=path).cpu_tier_blocks(0) == (0, 0)  # (nothing to swap)
    with pytest.raises(ValueError, match="no KV to offload"):
        EngineConfig(model=path, kv_offloading_size=1).cpu_tier_blocks(0)


def test_malformed_fields_are_named() -> None:
    mamba2 = {"model_type": "mamba2", "hidden_size": 64, "num_heads": 8, "head_dim": 16,
              "n_groups": 2}
    with pytest.raises(ValueError, match="'num_heads' \\(8\\) x 'head_dim' \\(8\\)"):
        mamba_lm_config({**mamba2, "head_dim": 8})
    with pytest.raises(ValueError, match="'n_groups' \\(3\\) must divide"):
        mamba_lm_config({**mamba2, "n_groups": 3})
    mamba = {"model_type": "mamba", "hidden_size": 64}
    with pytest.raises(ValueError, match="'conv_kernel' must be >= 2"):
        mamba_lm_config({**mamba, "conv_kernel": 1})
    with pytest.raises(ValueError, match="'time_step_rank' must be a positive integer"):
        mamba_lm_config({**mamba, "time_step_rank": -1})
    with pytest.raises(ValueError, match="'hidden_act' must be 'silu'"):
        mamba_lm_config({**mamba, "hidden_act": "gelu"})
