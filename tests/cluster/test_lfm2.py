"""Liquid AI's LFM2 (``lfm2``, ``lfm2_moe``): gated short-convolution layers around
attention.

Through the engine, against Hugging Face's ``generate`` on a file its own classes
wrote (conv, conv, attention, conv; 3-tap convolutions): greedy tokens equal over
prompts of 3 to 48 tokens twice in one batch, whole and in 8-token prefill chunks,
and with the prefix cache on (``mamba_cache_mode="align"``: a conversation continued
from its answer resumes from its convolution's snapshot); LFM2-MoE's experts route
as transformers' do. The first files' field
spellings (``full_attn_idxs``, ``block_ff_dim``, ``tie_embedding``) parse as
transformers reads them; a malformed layer list is named."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.lfm2_config import lfm2_config
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory, default_model_dir) -> tuple[str, list, list]:
    path = write_random_checkpoint(tmp_path_factory.mktemp("lfm2"), "lfm2", default_model_dir)
    prompts = prompts_of_mixed_lengths(6)
    return path, prompts, hf_greedy(path, prompts, GREEDY.max_tokens)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_hugging_face_whole_in_chunks_and_from_the_prefix_cache(lfm2) -> None:
    path, prompts, ref = lfm2
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4)
    try:
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
    finally:
        llm.shutdown()
    llm = LLM(model=path, num_gpu_blocks=160, block_size=4, max_num_batched_tokens=8,
              mamba_cache_mode="align")
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        turn2 = [p + r + [5] for p, r in zip(prompts, ref, strict=True)]
        want = hf_greedy(path, turn2[-2:], GREEDY.max_tokens)
        outs = llm.generate(turn2[-2:], GREEDY)
        assert _tokens(outs) == want
        assert [o.num_cached_tokens for o in outs] == [
            (len(p) + len(r) - 1) // 4 * 4 for p, r in zip(prompts[-2:], ref[-2:], strict=True)]
    finally:
        llm.shutdown()


def test_lfm2_moe_routes_its_later_layers_as_hugging_face_does(tmp_path,
                                                              default_model_dir) -> None:
    """LFM2-MoE: a dense first layer, then 4 experts with sigmoid scores, a random
    choosing bias and a routed scale of 1.5; prompts in 8-token chunks."""
    path = write_random_checkpoint(tmp_path / "moe", "lfm2_moe", default_model_dir)
    prompts = prompts_of_mixed_lengths(4)[1:]
    ref = hf_greedy(path, prompts, 6)
    llm = LLM(model=path, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8)
    try:
        assert llm.engine.executor.worker.model_config.moe.sparse_layers == (1, 2, 3)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True))
        assert _tokens(outs) == ref
    finally:
        llm.shutdown()


def test_the_first_files_spellings_parse_and_bad_layers_are_named() -> None:
    cfg, conv = lfm2_config({"num_hidden_layers": 4, "hidden_size": 64, "full_attn_idxs": [1],
                             "block_ff_dim": 192, "block_multiple_of": 32,
                             "tie_embedding": False, "norm_eps": 1e-6, "conv_L_cache": 4})
    assert (conv.layers, conv.attention, conv.d_conv) == ((0, 2, 3), (1,), 4)
    assert (cfg["intermediate_size"], cfg["tie_word_embeddings"], cfg["rms_norm_eps"]) == (
        128, False, 1e-6)
    with pytest.raises(ValueError, match="'layer_types'"):
        lfm2_config({"num_hidden_layers": 2, "layer_types": ["conv", "mamba"]})
