"""TP=2 (two gloo processes) gives the same logits and greedy tokens as TP=1.

Covers KV heads split across ranks (4 q / 2 kv heads), a single KV head
replicated on both ranks (4 q / 1 kv), an odd vocabulary (padded vocab shards),
a biased Qwen2 attention, Qwen3's per-head q/k norms (replicated on each rank),
mixtures of experts (every expert cut along its intermediate dimension, Qwen2-MoE's
shared expert too, one all-reduce per layer), DeepSeek's latent attention (heads
split, the latent cache whole on each rank) with grouped routing, and GPT-OSS (its
attention sinks split with the heads, its experts' down bias added by one rank), and
OLMo's q / k norms over whole projections (each rank's squares all-reduced, a
replicated KV head counted once per rank), and the hybrids' recurrent mixers (Mamba-2
heads and groups, gated DeltaNet key heads in both projection layouts, LFM2's
convolution channels).

Every case's TP=2 run happens in one spawn of two ranks (``tp2_runs``), one case
after another, each with its own process group; each test then runs TP=1 in process
and compares. A case that fails on a rank ends the spawn at once, naming the case.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from pagedserve.worker.layers.moe import SparseMoE
from tests.cluster.test_nemotron_h import NEMOTRON3
from tests.worker.helpers import BlockAllocator, make_worker, plan, request, save_tiny_model

PROMPTS = {"a": [5, 9, 17, 33, 4, 12, 7], "b": [8, 70, 12, 44, 90, 3, 61, 22, 19, 30, 2]}


def _run(worker, n_decode: int):
    """Logits of every prefill row, then greedy tokens for ``n_decode`` steps (rank 0 only)."""
    alloc = BlockAllocator(40, 4, seed=11, groups=worker.kv_layout.num_groups)
    prompts = PROMPTS
    logits = _logits_or_none(worker, plan(0, [request(alloc, r, p, 0, sample=False)
                                              for r, p in prompts.items()]))
    # Re-run the prompts as fresh requests through execute() and decode greedily.
    toks = {r: [] for r in prompts}
    reqs = [request(alloc, r + "2", p, 0) for r, p in prompts.items()]
    for step in range(1, n_decode + 1):
        out = worker.execute_model(plan(step, reqs))
        # Only rank 0 samples; the engine sends its tokens to every rank in the next plan.
        tok_t = torch.tensor([0 if out is None else out.sampled[r + "2"].token_id
                              for r in prompts])
        worker.ctx.all_reduce(tok_t)
        reqs = []
        for (r, p), t in zip(prompts.items(), tok_t.tolist()):
            toks[r].append(t)
            reqs.append(request(alloc, r + "2", [t], len(p) + len(toks[r]) - 1))
    return logits, toks


def _logits_or_none(worker, p):
    """Every row's logits on rank 0, None on rank 1 (all ranks must run the gather)."""
    runner = worker.runner
    with torch.inference_mode():
        inputs = runner.prepare_inputs(p)
        hidden = runner.forward_hidden(inputs)
        return worker.model.compute_logits(hidden)


def _rank_main(rank: int, path: str, init: str, result: str, quant: str | None = None,
               placement: str | None = None) -> None:
    torch.set_num_threads(1)
    worker = make_worker(path, num_blocks=40, block_size=4, tensor_parallel_size=2, rank=rank,
                         dist_init_method=init, num_threads=1, quantization=quant,
                         enable_expert_parallel=placement is not None,
                         expert_placement_strategy=placement or "linear")
    if placement is not None:  # whole experts, a share each: 5 over 2 is 3 + 2 (linear)
        held = next(m for m in worker.model.modules() if isinstance(m, SparseMoE)).held
        want = ([0, 1, 2], [3, 4])[rank] if placement == "linear" else list(range(rank, 8, 2))
        assert held == want
    logits, toks = _run(worker, 4)
    if rank == 0:
        torch.save({"logits": logits, "toks": toks,
                    "kv_heads": worker.model.num_kv_heads_per_rank}, result)
    else:
        assert logits is None
    worker.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TP_CASES = {  # id -> (model kind, config overrides)
    "kv_split": ("llama", dict(num_key_value_heads=2)),
    "kv_replicated_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2)),
    "qwen3_qk_norm": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
    "mixtral_experts": ("mixtral", dict(num_key_value_heads=2)),
    "qwen2_moe_shared_expert": ("qwen2_moe", dict(num_key_value_heads=2)),
    "gemma3_sliding": ("gemma3_text", dict(num_key_value_heads=2, head_dim=16,
                                           sliding_window=5,
                                           layer_types=["sliding_attention",
                                                        "full_attention"])),
    "phi3_fused": ("phi3", dict(num_key_value_heads=2, pad_token_id=0)),
    "deepseek_v3_mla": ("deepseek_v3", dict(num_key_value_heads=2)),
    "deepseek_v2_mla": ("deepseek_v2", dict(num_key_value_heads=2)),
    "gpt_oss_sinks_biased_experts": ("gpt_oss", dict(num_key_value_heads=2, sliding_window=5)),
    "granite_moe_shared_scaled": ("granitemoeshared", dict(
        num_key_value_heads=2, embedding_multiplier=6.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=4.0)),
    "olmo2_sharded_qk_norms": ("olmo2", dict(num_key_value_heads=2)),
    "glm4_moe_partial_rope_grouped_experts": ("glm4_moe", dict(num_key_value_heads=2)),
    "ernie_interleaved_rope": ("ernie4_5", dict(num_key_value_heads=2, head_dim=16)),
    "glm4_sandwich_norms_fused_gate_up": ("glm4", dict(num_key_value_heads=2, head_dim=16,
                                                       pad_token_id=0)),
    "ernie_moe_biased_choice_shared": ("ernie4_5_moe", dict(num_key_value_heads=2)),
    "olmo3_replicated_kv_head_norm": ("olmo3", dict(
        num_key_value_heads=1, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])),
    "nemotron_h_mamba_heads_and_groups_split": ("nemotron_h", dict(num_key_value_heads=2)),
    "qwen3_next_deltanet_key_heads_and_attention_gate_split": (
        "qwen3_next", dict(num_key_value_heads=2)),
    "qwen3_5_unfused_deltanet_projections_split": ("qwen3_5", dict(num_key_value_heads=2)),
    "lfm2_short_conv_channels_split": ("lfm2", dict(num_key_value_heads=2)),
    "falcon_h1_mixer_beside_attention_multipliers_folded": (
        "falcon_h1", dict(num_key_value_heads=2)),
    "jamba_mamba1_channels_split_x_proj_reduced": ("jamba", dict(num_key_value_heads=2)),
    "nemotron3_relu2_experts_and_shared_split": ("nemotron_h", dict(
        num_key_value_heads=2, **NEMOTRON3)),
    "mamba_attention_free_no_kv": ("mamba", {}),
    "mamba2_attention_free_heads_split": ("mamba2", {}),
}
EP_CASES = {  # id -> (model kind, config overrides, expert placement)
    "mixtral_uneven": ("mixtral", dict(num_local_experts=5), "linear"),
    "qwen2_moe_shared_expert": ("qwen2_moe", dict(num_experts=8), "round_robin"),
    "deepseek_v3_groups": ("deepseek_v3", {}, "round_robin"),
    "gpt_oss_expert_biases": ("gpt_oss", dict(num_local_experts=5), "linear"),
    "nemotron3_relu2_experts": ("nemotron_h", NEMOTRON3, "round_robin"),
}
QUANT_CASES = ("int8", "int4")


def _rank_jobs(rank: int, jobs: list[tuple]) -> None:
    """Every case's TP=2 run on this rank, one after another in one process (a spawn
    per case cost two interpreter starts each); a failing case names itself."""
    for name, path, init, result, quant, placement in jobs:
        try:
            _rank_main(rank, path, init, result, quant, placement)
        except Exception as e:
            raise RuntimeError(f"TP=2 case {name!r} failed on rank {rank}") from e


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each case's checkpoint and its TP=2 result file, all run in one spawn of two
    gloo ranks."""
    root = tmp_path_factory.mktemp("tp2")
    cases: dict[str, tuple[str, str | None, str | None]] = {}
    for name, (kind, kw) in TP_CASES.items():
        path = save_tiny_model(root / f"tp-{name}", kind, seed=4, **kw)
        cases[f"tp-{name}"] = (str(path), None, None)
    for name, (kind, kw, placement) in EP_CASES.items():
        path = save_tiny_model(root / f"ep-{name}", kind, seed=4, num_key_value_heads=2, **kw)
        cases[f"ep-{name}"] = (str(path), None, placement)
    llama = save_tiny_model(root / "quant", "llama", seed=4, intermediate_size=128)
    for method in QUANT_CASES:
        cases[f"quant-{method}"] = (str(llama), method, None)
    jobs = [(name, path, f"tcp://127.0.0.1:{_free_port()}", str(root / f"{name}.pt"), quant,
             placement) for name, (path, quant, placement) in cases.items()]
    mp.spawn(_rank_jobs, args=(jobs,), nprocs=2, join=True)
    return {job[0]: (job[1], job[3]) for job in jobs}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp2_equals_tp1(tp2_runs, case):
    path, result = tp2_runs[f"tp-{case}"]
    ref_worker = make_worker(path, num_blocks=40, block_size=4)
    ref_logits, ref_toks = _run(ref_worker, 4)
    got = torch.load(result)
    torch.testing.assert_close(got["logits"], ref_logits, atol=2e-5, rtol=1e-4)
    assert got["toks"] == ref_toks
    assert got["kv_heads"] == max(1, TP_CASES[case][1].get("num_key_value_heads", 1) // 2)


@pytest.mark.parametrize("case", list(EP_CASES))
def test_tp2_expert_parallel_equals_tp1(tp2_runs, case):
    """Expert parallelism over a gloo group: each rank holds whole experts, attention
    stays split by heads, and the layer's one all-reduce adds the ranks' experts (and
    the shared expert's TP halves): TP=1's logits and greedy tokens."""
    path, result = tp2_runs[f"ep-{case}"]
    ref_worker = make_worker(path, num_blocks=40, block_size=4)
    ref_logits, ref_toks = _run(ref_worker, 4)
    got = torch.load(result)
    torch.testing.assert_close(got["logits"], ref_logits, atol=2e-5, rtol=1e-4)
    assert got["toks"] == ref_toks


@pytest.mark.parametrize("method", QUANT_CASES)
def test_tp2_equals_tp1_with_int8_weights(tp2_runs, method):
    """Column shards keep whole rows and row shards whole 32-input groups, so both ranks
    hold exactly TP=1's codes; logits differ only by the all-reduce's summation order."""
    path, result = tp2_runs[f"quant-{method}"]
    ref_worker = make_worker(path, num_blocks=40, block_size=4, quantization=method)
    assert ref_worker.model.layers[0].mlp.down_proj.quant is not None
    ref_logits, ref_toks = _run(ref_worker, 4)
    got = torch.load(result)
    torch.testing.assert_close(got["logits"], ref_logits, atol=1e-4, rtol=1e-4)
    assert got["toks"] == ref_toks
