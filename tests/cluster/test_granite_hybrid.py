"""Granite 4.0-H (``granitemoehybrid``): Mamba-2 layers around an attention layer.

Through the engine, against Hugging Face's ``generate`` (its torch Mamba path):
greedy tokens equal over prompts that span several scan chunks, whole and in
prefill chunks mixed with decodes, dense and with experts; under swap and
recompute preemption (a state kept in its slot, a state rebuilt from token 0); for
``n = 2`` siblings forking at the prompt's end. The chunked scan equals the
token-by-token recurrence it replaces, from any starting state; slots are reused,
grown and forked; what these models cannot serve is refused by name, and prefix
caching is off by default (a cached prefix holds no state). IBM's Bamba, the same
mixer in Llama-shaped layers, equals transformers too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.beam_search import BeamSearchParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.recurrent_engine import recurrent_engine_config
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.mamba2 import Mamba2Mixer, ssd_scan
from pagedserve.worker.mamba_config import MambaConfig, mamba_config_from_hf
from pagedserve.worker.mamba_state import MambaStates
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _checkpoint(tmp_path_factory, tokenizer_dir: str, **extra) -> tuple[str, list, list]:
    """A checkpoint, prompts of 3 to 48 tokens (up to six 8-token scan chunks), and HF's
    greedy tokens for them."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("hybrid"), "granitemoehybrid",
                                   tokenizer_dir, **extra)
    prompts = prompts_of_mixed_lengths(6)
    return path, prompts, hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, default_model_dir) -> tuple[str, list, list]:
    """With routed experts beside the shared MLP."""
    return _checkpoint(tmp_path_factory, default_model_dir)


@pytest.fixture(scope="module")
def hybrid_dense(tmp_path_factory, default_model_dir) -> tuple[str, list, list]:
    """granite-4.0-h-micro's shape: the shared MLP alone."""
    return _checkpoint(tmp_path_factory, default_model_dir, num_local_experts=0)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("fixture", ["hybrid", "hybrid_dense"])
def test_greedy_equals_hugging_face_whole_and_in_prefill_chunks(fixture, request) -> None:
    path, prompts, ref = request.getfixturevalue(fixture)
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4)
    try:
        assert llm.engine.scheduler.kv.pool.enable_caching is False  # (no state in a prefix)
        # Twice each: the second copy would be a prefix hit with caching on.
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
    finally:
        llm.shutdown()
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4, max_num_batched_tokens=8)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_resume_with_their_state(hybrid, mode) -> None:
    path, prompts, ref = hybrid
    llm = LLM(model=path, num_gpu_blocks=24, block_size=4, preemption_mode=mode)
    try:
        first = llm.generate(prompts, GREEDY)
        assert _tokens(first) == ref
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        llm.generate(prompts[:1], GREEDY)
        # Finished sequences give their slots back (on the next step's plan).
        held = set(llm.engine.executor.worker.runner.states.slot_of)
        assert not held & {o.request_id for o in first}, held
    finally:
        llm.shutdown()


def test_siblings_fork_the_prompts_state(hybrid) -> None:
    path, prompts, ref = hybrid
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4)
    try:
        (out,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=10,
                                                            ignore_eos=True, n=2))
        assert [c.token_ids for c in out.outputs] == [ref[4], ref[4]]
        with pytest.raises(ValueError, match="beam search is not supported"):
            llm.engine.add_request(prompts[0], beam=BeamSearchParams(beam_width=2,
                                                                     max_tokens=4))
    finally:
        llm.shutdown()


def test_what_it_cannot_serve_is_refused_by_name(hybrid, tmp_path) -> None:
    path = hybrid[0]
    with pytest.raises(ValueError, match="kv_offloading_size is not supported for recurrent"):
        LLM(model=path, num_gpu_blocks=32, kv_offloading_size=1)
    mc = MambaConfig((0,), (), num_heads=4, head_dim=8, d_state=4, num_groups=1, d_conv=4,
                     chunk_size=8, conv_bias=True, proj_bias=False)
    with pytest.raises(ValueError, match="mamba_n_groups"):
        Mamba2Mixer(32, mc, 1e-5, SimpleNamespace(world_size=2, rank=0), torch.float32,
                    torch.device("cpu"), 0)


@pytest.mark.parametrize("length", [1, 7, 8, 29])
def test_chunked_scan_equals_the_recurrence(length) -> None:
    """The chunked scan (chunks of 8) against ``h = exp(dt a) h + dt b x``, ``y = c h``
    one token at a time, from a non-zero state."""
    g = torch.Generator().manual_seed(length)
    heads, p, n = 3, 4, 5
    x = torch.randn(length, heads, p, generator=g)
    dt = torch.rand(length, heads, generator=g)
    a = -torch.rand(heads, generator=g) * 2
    b = torch.randn(length, heads, n, generator=g)
    c = torch.randn(length, heads, n, generator=g)
    h0 = torch.randn(heads, p, n, generator=g)
    y, final = ssd_scan(x, dt, a, b, c, 8, h0)
    h, want = h0, []
    for t in range(length):
        h = h * torch.exp(dt[t] * a)[:, None, None] \
            + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        want.append(torch.einsum("hpn,hn->hp", h, c[t]))
    torch.testing.assert_close(y, torch.stack(want), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, h, atol=1e-5, rtol=1e-5)


def _row(rid: str, start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(rid, list(range(n)), start, [], [rid], {})


def test_slots_are_zeroed_reused_grown_and_forked() -> None:
    states = MambaStates((3, 2), (2, 2, 2), 2, torch.float32, torch.device("cpu"), capacity=2)
    step = states.step([_row("a", 0, 5), _row("b", 0, 1)])
    assert states.slot_of == {"a": 0, "b": 1} and step.multi == [(0, 5, 0)]
    (rows, slots), = step.batches
    assert slots.tolist() == [1] and rows.tolist() == [5]
    states.ssm[1][0].fill_(7.0)
    states.step([_row("c", 0, 2)])  # a third sequence: the slots double
    assert states.capacity == 4 and states.slot_of["c"] == 2
    assert float(states.ssm[1][0].sum()) == 7.0 * 8  # (held states kept)
    states.fork("a", ["a1"])
    assert float(states.ssm[1][states.slot_of["a1"]].sum()) == 7.0 * 8
    states.forget(["a", "b"])
    step = states.step([_row("d", 0, 1), _row("c", 2, 1)])  # all single: rows in order
    assert step.batches[0][0] is None and float(states.ssm[1][states.slot_of["d"]].sum()) == 0
    with pytest.raises(ValueError, match="without its Mamba state"):
        states.step([_row("e", 4, 1)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["granitemoehybrid", "nemotron_h", "qwen3_next",
                                  "falcon_h1", "jamba", "mamba", "mamba2"])
def test_hybrids_on_cuda_equal_hugging_face(kind, tmp_path) -> None:
    """Granite 4.0-H, Nemotron-H, Qwen3-Next, Falcon-H1, Jamba and the attention-free
    Mamba and Mamba-2 on CUDA (the mixers' torch paths, Mamba-1's and DeltaNet's
    Triton kernels, Triton attention, eager steps) against HF on the same device:
    mixed prompts and one of 300 tokens (38 scan chunks, 5 delta-rule chunks), twice."""
    path = write_random_checkpoint(tmp_path / kind, kind, None)
    prompts = [*prompts_of_mixed_lengths(), [(7 * j) % 4000 + 100 for j in range(300)]]
    ref = hf_greedy(path, prompts, 20, device="cuda")
    llm = LLM(model=path, device="cuda", dtype="float32", num_gpu_blocks=256, block_size=16,
              attention_backend="triton")
    try:
        for _ in range(2):
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                        ignore_eos=True))
            assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.engine.executor.worker.runner.graphs is None  # (eager: see models.hybrid)
    finally:
        llm.shutdown()


def test_bamba_equals_hugging_face_in_prefill_chunks(tmp_path, default_model_dir) -> None:
    """IBM's Bamba: Granite 4.0-H's mixer in Llama-shaped layers, its attention layer
    given by index and rotating half of each head; the files' own MLP and norm names."""
    path = write_random_checkpoint(tmp_path / "bamba", "bamba", default_model_dir)
    prompts = prompts_of_mixed_lengths(5)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4, max_num_batched_tokens=8)
    try:
        config = llm.engine.executor.worker.model_config
        assert (config.mamba.attention, config.rotary_dim) == ((1,), 8)
        assert _tokens(llm.generate(prompts + prompts, GREEDY)) == ref + ref
    finally:
        llm.shutdown()
    bad = {"model_type": "bamba", "attn_layer_indices": "1", "hidden_size": 64}
    with pytest.raises(ValueError, match="'attn_layer_indices'"):
        mamba_config_from_hf(bad, "bamba", 4)


def test_cpu_max_num_seqs_fits_half_the_budget_with_guesses_and_stages(hybrid) -> None:
    """On CPU ``max_num_seqs`` is lowered until that many sequences' states take half the
    KV budget: each guess's kept state counts, and a pipeline stage counts its own
    layers' (layers 0, 2 and 3 are Mamba: stages of 0-1 and 2-3 keep one and two)."""
    path = hybrid[0]
    per_seq = ModelConfig.from_pretrained(path).mamba.state_bytes(4)  # (fp32)
    budget = 2 * 10 * per_seq

    def cap(**kw) -> int:
        config = EngineConfig(model=path, device="cpu", dtype="float32", max_num_seqs=64,
                              **{"kv_cache_memory_bytes": budget, **kw})
        return recurrent_engine_config(config, path).max_num_seqs

    assert cap() == 10
    assert cap(speculative_config={"method": "ngram", "num_speculative_tokens": 4}) == 2
    assert cap(pipeline_parallel_size=2) == budget // 2 // (per_seq * 2 // 3) == 15
    assert cap(kv_cache_memory_bytes=None, num_gpu_blocks=32) == 64  # (explicit pool: kept)
