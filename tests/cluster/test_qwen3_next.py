"""Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``): gated
DeltaNet layers before a gated attention layer.

Through the engine, against Hugging Face's ``generate`` (its torch DeltaNet path) on
files its own classes wrote: greedy tokens equal over prompts of 3 to 150 tokens
(past one 64-token chunk of the delta rule), twice in one batch, whole and in
8-token prefill chunks mixed with decodes; under swap preemption and for ``n = 2``
siblings. Qwen3.5's multimodal files serve their decoder (unfused projections, the
vision encoder never read). The chunked delta rule equals the token-by-token one
from any starting state; the file's MTP module is skipped; malformed fields are
named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.deltanet_config import DeltaNetConfig, deltanet_config_from_hf
from pagedserve.worker.layers.gated_deltanet import GatedDeltaNet, chunk_gated_delta_rule
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, default_model_dir) -> tuple[str, list, list]:
    """A checkpoint with an MTP tensor added (as the release has), prompts of 3 to 150
    tokens, and HF's greedy tokens for them."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next",
                                   default_model_dir)
    prompts = [*prompts_of_mixed_lengths(6), [(7 * j) % 4000 + 100 for j in range(150)]]
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    tensors = load_file(f"{path}/model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)  # (never read)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path, prompts, ref


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_hugging_face_whole_and_in_prefill_chunks(qwen3_next) -> None:
    path, prompts, ref = qwen3_next
    mc = ModelConfig.from_pretrained(path)
    assert (mc.mamba.layers, mc.mamba.attention, mc.rotary_dim) == ((0, 1, 2), (3,), 4)
    llm = LLM(model=path, num_gpu_blocks=160, block_size=4)
    try:
        assert llm.engine.scheduler.kv.pool.enable_caching is False  # (no state in a prefix)
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
    finally:
        llm.shutdown()
    llm = LLM(model=path, num_gpu_blocks=160, block_size=4, max_num_batched_tokens=8)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_files_serve_their_decoder(kind, tmp_path, default_model_dir) -> None:
    path = write_random_checkpoint(tmp_path / kind, kind, default_model_dir)
    prompts = [*prompts_of_mixed_lengths(5), [(5 * j) % 4000 + 100 for j in range(90)]]
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    mc = ModelConfig.from_pretrained(path)
    assert mc.mamba.split_proj and mc.image is None and (mc.moe is not None) == (
        kind == "qwen3_5_moe")
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4, max_num_batched_tokens=32)
    try:
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
    finally:
        llm.shutdown()


def test_swapped_sequences_resume_and_siblings_fork(qwen3_next) -> None:
    path, prompts, ref = qwen3_next
    llm = LLM(model=path, num_gpu_blocks=24, block_size=4, preemption_mode="swap")
    try:
        assert _tokens(llm.generate(prompts[:6], GREEDY)) == ref[:6]
        assert llm.engine.scheduler.num_preemptions["swap"] > 0
        (out,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=10,
                                                            ignore_eos=True, n=2))
        assert [c.token_ids for c in out.outputs] == [ref[4], ref[4]]
    finally:
        llm.shutdown()


def _recurrence(q, k, v, g, beta, s):
    """The gated delta rule one token at a time (transformers' recurrent form)."""
    outs = []
    for t in range(k.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs), s


@pytest.mark.parametrize("length,chunk", [(1, 64), (7, 4), (64, 64), (150, 64), (29, 8)])
def test_chunked_delta_rule_equals_the_recurrence(length, chunk) -> None:
    g_ = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g_), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g_), dim=-1)
    v = torch.randn(length, heads, dv, generator=g_)
    g = -torch.rand(length, heads, generator=g_)
    beta = torch.rand(length, heads, generator=g_)
    s0 = torch.randn(heads, dk, dv, generator=g_)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk)
    want, s = _recurrence(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, s, atol=1e-4, rtol=1e-4)


def test_malformed_fields_are_named() -> None:
    base = {"num_hidden_layers": 4}
    with pytest.raises(ValueError, match="'layer_types'"):
        deltanet_config_from_hf({**base, "layer_types": ["linear_attention", "mamba"]}, 4)
    with pytest.raises(ValueError, match="'linear_num_key_heads'"):
        deltanet_config_from_hf({"linear_num_key_heads": 3, "linear_num_value_heads": 4}, 4)
    assert deltanet_config_from_hf({"full_attention_interval": 2}, 4).attention == (1, 3)
    dc = DeltaNetConfig((0,), (1,), num_k_heads=3, num_v_heads=6, head_k_dim=8,
                        head_v_dim=8, d_conv=4)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        GatedDeltaNet(32, dc, 1e-6, SimpleNamespace(world_size=2, rank=0), torch.float32,
                      torch.device("cpu"))
