"""Expert parallelism (``layers.expert_placement``): which experts a rank holds, and one
MoE layer split over 2-4 ranks whose parts add up to Hugging Face's block.

The ranks here are layers built with a rank's ``ParallelContext`` in one process; the
all-reduce is the test's own sum of their outputs (``test_tensor_parallel.py`` and
``tests/cluster/test_tensor_parallel_ray.py`` run real process groups).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_int8, cpu_native
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.expert_placement import (
    expert_map,
    expert_parallel_problem,
    local_experts,
)
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.worker_config import WorkerConfig
from tests.worker.test_moe_layer import HIDDEN, _checkpoint_tensors, _hf_block


class _OwnSum(ParallelContext):
    """A rank whose all-reduce is left to the test (it sums the ranks' outputs)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("num_experts,world", [(8, 2), (10, 4), (5, 3), (4, 4), (256, 64)])
def test_placements_cover_every_expert_once_and_evenly(num_experts, world) -> None:
    for strategy in ("linear", "round_robin"):
        held = [local_experts(num_experts, r, world, strategy) for r in range(world)]
        assert sorted(e for h in held for e in h) == list(range(num_experts))
        assert max(map(len, held)) - min(map(len, held)) <= 1
        for h in held:
            assert h == sorted(h) and h
            if strategy == "linear":
                assert h == list(range(h[0], h[0] + len(h)))
    # vLLM's linear split: the first E % W ranks hold one more.
    assert [local_experts(10, r, 4, "linear") for r in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert local_experts(10, 1, 4, "round_robin") == [1, 5, 9]
    table = expert_map(10, [3, 4, 5], torch.device("cpu"))
    assert table.tolist() == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]


def test_bad_settings_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="expert_placement_strategy"):
        local_experts(8, 0, 2, "random")
    with pytest.raises(ValueError, match="expert_placement_strategy"):
        WorkerConfig(expert_placement_strategy="packed")
    assert expert_parallel_problem(4, 4) is None
    assert "4 routed experts cannot give each of 8 ranks" in expert_parallel_problem(4, 8)
    cfg, _ = _hf_block("mixtral")
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": "mixtral",
                                        "num_hidden_layers": 1}).moe
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        SparseMoE(HIDDEN, moe_cfg, _OwnSum(0, 8, expert_parallel=True), torch.float32,
                  torch.device("cpu"))


def _hf(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's block on rows ``x`` (some blocks also return their router logits)."""
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out)[0]


def _ranks(kind: str, overrides: dict, world: int, strategy: str, dtype=torch.float32):
    cfg, block = _hf_block(kind, **overrides)
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": kind,
                                        "num_hidden_layers": 1}).moe
    tensors = _checkpoint_tensors(block, moe_cfg.mixtral_names)
    ranks = []
    for r in range(world):
        ctx = _OwnSum(r, world, expert_parallel=True, expert_placement=strategy)
        layer = SparseMoE(HIDDEN, moe_cfg, ctx, dtype, torch.device("cpu"))
        assert set(tensors) == layer.expected_names()
        for name, t in tensors.items():
            assert layer.load(name, t)
        ranks.append(layer)
    return block, ranks


@pytest.mark.parametrize("path", ["plain", "native", "int8"])
@pytest.mark.parametrize("kind,overrides,world,strategy", [
    ("mixtral", {}, 2, "linear"),
    ("qwen2_moe", {}, 2, "round_robin"),  # its gated shared expert split by TP as before
    ("qwen3_moe", dict(num_experts=10, num_experts_per_tok=3), 4, "linear"),  # 3,3,2,2
    ("deepseek_v3", {}, 4, "round_robin"),  # grouped routing with its bias, 2 a rank
    ("deepseek_v3", {}, 8, "linear"),  # one expert a rank, below the top-k
], ids=["mixtral_2", "qwen2_moe_shared_rr_2", "qwen3_moe_uneven_4", "deepseek_v3_rr_4",
        "deepseek_v3_one_each_8"])
def test_ranks_parts_add_up_to_the_whole_block(kind, overrides, world, strategy, path) -> None:
    """Every rank routes every row the same way and runs only its own experts at full
    width: the ranks' outputs summed (the layer's all-reduce) are HF's block, from a
    decode row to a 300-row prefill, through the expert loop, the native kernel and
    int8 experts (the native int8 kernel where there is one)."""
    if path == "native" and cpu_native.load() is None:
        pytest.skip("no C compiler: native CPU kernels off")
    block, ranks = _ranks(kind, overrides, world, strategy)
    for layer in ranks:
        assert layer.w13.shape[:2] == (layer.num_local_experts, 2 * layer.full_i)
        if path == "native":
            layer.pack()
            assert layer.native is not None
        elif path == "int8":
            layer.quantize("layers.0.mlp")
    assert sum(layer.num_local_experts for layer in ranks) == ranks[0].num_experts
    g = torch.Generator().manual_seed(world)
    for rows in (1, 7, 300):
        x = torch.randn(rows, HIDDEN, generator=g)
        with torch.no_grad():
            ref, got = _hf(block, x), sum(layer(x) for layer in ranks)
        if path == "int8":
            assert float((got - ref).norm() / ref.norm()) < 0.02
        else:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_int8.native_available(), reason="no native int8 kernel here")
def test_int8_kernel_equals_the_expert_loop_on_a_ranks_share(monkeypatch) -> None:
    """The native int8 call skips another rank's pairs exactly as the per-expert loop
    does: same codes, same sums, rank by rank."""
    for native in (True, False):
        monkeypatch.setattr(cpu_int8, "native_available", lambda n=native: n)
        _, ranks = _ranks("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3), 3, "linear")
        for layer in ranks:
            layer.quantize("layers.0.mlp")
        if native:
            fused = ranks
        else:
            loop = ranks
    x = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(5))
    for a, b in zip(fused, loop, strict=True):
        assert a.int8_native is not None and b.int8 is not None
        b.int8 = [(cpu_int8.pack(u), cpu_int8.pack(v)) for u, v in b.int8]  # the kernel's
        with torch.no_grad():
            torch.testing.assert_close(a(x), b(x), atol=1e-5, rtol=1e-5)


def test_a_rank_reads_only_its_own_experts() -> None:
    """Another rank's expert tensors are taken (the checkpoint holds them) but never
    read: a tensor that fails when read proves it."""
    class Unreadable:
        shape = (32, HIDDEN)

        def __getitem__(self, item):
            raise AssertionError("read another rank's expert")

    _, (rank0, rank1) = _ranks("mixtral", {}, 2, "linear")
    assert rank0.held == [0, 1] and rank1.held == [2, 3]
    assert rank0.load("experts.3.w1.weight", Unreadable())
    assert not rank0.load("experts.4.w1.weight", Unreadable())  # past the last expert
    with pytest.raises(ValueError, match="checkpoint shape"):
        rank0.load("experts.1.w2.weight", torch.zeros(32, HIDDEN))


def test_expert_widths_tensor_parallelism_cannot_cut_are_served_whole() -> None:
    """Experts 32 wide cannot be cut for three ranks (nor, 96 wide, into two int8 halves
    of whole 32-input groups); whole experts can, and still add up to HF's block."""
    cfg, _ = _hf_block("qwen3_moe")
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": "qwen3_moe",
                                        "num_hidden_layers": 1}).moe
    with pytest.raises(ValueError, match="not divisible by TP size 3"):
        SparseMoE(HIDDEN, moe_cfg, _OwnSum(0, 3), torch.float32, torch.device("cpu"))
    block, ranks = _ranks("qwen3_moe", {}, 3, "linear")
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(sum(layer(x) for layer in ranks), _hf(block, x),
                                   atol=1e-5, rtol=1e-5)
    wide = dict(moe_intermediate_size=96)
    sharded_half = SparseMoE(HIDDEN, ModelConfig.from_hf_dict(
        {**cfg.to_dict(), "model_type": "qwen3_moe", "num_hidden_layers": 1, **wide}).moe,
        _OwnSum(0, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="64 / 48 inputs per rank"):
        sharded_half.quantize("layers.0.mlp")
    block, ranks = _ranks("qwen3_moe", wide, 2, "round_robin")
    for layer in ranks:
        layer.quantize("layers.0.mlp")
    with torch.no_grad():
        ref, got = _hf(block, x), sum(layer(x) for layer in ranks)
    assert float((got - ref).norm() / ref.norm()) < 0.02


def test_rank_zero_counts_every_ranks_routed_pairs() -> None:
    """Routing is replicated, so rank 0 alone counts each rank's pairs; taking them
    reads and clears them, and the balance is the mean rank over the busiest."""
    from pagedserve.worker.layers.expert_placement import balance
    from pagedserve.worker.layers.moe import take_expert_load
    from pagedserve.worker.layers.moe_routing import route

    _, ranks = _ranks("deepseek_v3", {}, 4, "round_robin")
    rank0, others = ranks[0], ranks[1:]
    assert rank0.rank_pairs is not None and all(r.rank_pairs is None for r in others)
    model = torch.nn.ModuleList(ranks)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        for layer in ranks:
            layer(x)
        _, experts = route(rank0.gate_linear(x.float(), rank0.router), rank0.moe,
                           rank0.score_bias)
    want = torch.bincount(experts.reshape(-1) % 4, minlength=4)  # round robin: e % 4
    assert rank0.rank_pairs.tolist() == want.tolist()
    load = take_expert_load(model)
    assert load == {"expert_parallel_routed_pairs": 26,
                    "expert_parallel_busiest_pairs": int(want.max())}
    assert not rank0.rank_pairs.any()
    assert take_expert_load(model)["expert_parallel_routed_pairs"] == 0
    assert balance(load, 4) == 26 / (4 * int(want.max()))
    assert balance({}, 4) is None
    assert take_expert_load(torch.nn.ModuleList(others)) == {}
