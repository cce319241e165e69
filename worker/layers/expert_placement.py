"""Which routed experts a rank holds under expert parallelism (vLLM's
``--enable-expert-parallel`` and ``expert_placement_strategy``).

By default every tensor-parallel rank holds a slice of every expert (``layers.moe``):
each expert's matmuls are cut to ``1 / TP`` of the checkpoint's width, which must
divide by TP (and, for int8 weights, leave whole 32-input groups). Under expert
parallelism a rank holds whole experts, a share of the layer's experts each: a
token's routed experts run on the ranks that hold them at full width, and the one
all-reduce the layer already pays sums the ranks' parts. The router stays replicated,
so every rank routes every token the same way and computes only the pairs that land
on its own experts.

Placement: ``linear`` gives rank r a contiguous run (the first ``E % W`` ranks one
expert more, as vLLM does); ``round_robin`` gives it experts r, r + W, r + 2W, ...,
which spreads a DeepSeek-V3 group of neighbouring experts (its routing picks whole
groups) over every rank instead of piling it onto one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PLACEMENTS = ("linear", "round_robin")


def check_placement(strategy: str) -> None:
    """A ``ValueError`` naming the field for a strategy we do not know."""
    if strategy not in PLACEMENTS:
        raise ValueError(f"expert_placement_strategy must be one of {PLACEMENTS}, "
                         f"got {strategy!r}")


def expert_parallel_problem(num_experts: int, world_size: int) -> str | None:
    """Why ``num_experts`` routed experts cannot spread over ``world_size`` ranks, or
    None: every rank must hold at least one (a rank with none would still have to
    join every layer's all-reduce, and its kernels take no empty expert stacks)."""
    if num_experts < world_size:
        return (f"enable_expert_parallel: {num_experts} routed experts cannot give each of "
                f"{world_size} ranks one; use a tensor-parallel size of at most {num_experts} "
                "or leave expert parallelism off")
    return None


def local_experts(num_experts: int, rank: int, world_size: int, strategy: str) -> list[int]:
    """The global ids of the experts ``rank`` holds, ascending."""
    check_placement(strategy)
    if strategy == "round_robin":
        return list(range(rank, num_experts, world_size))
    base, extra = divmod(num_experts, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def owners(num_experts: int, world_size: int, strategy: str) -> list[int]:
    """The rank that holds each expert, by global id."""
    out = [0] * num_experts
    for rank in range(world_size):
        for e in local_experts(num_experts, rank, world_size, strategy):
            out[e] = rank
    return out


def balance(stats: Mapping[str, float], world_size: int) -> float | None:
    """vLLM's EPLB balancedness over the layer-steps an engine's ``stats`` counted
    (``layers.moe.take_expert_load``): the mean rank's routed pairs over the busiest
    rank's, each layer of each step a rendezvous the busiest rank sets the pace of
    (1.0: even; 1 / W: one rank took every pair). None before any pair was counted."""
    busiest = stats.get("expert_parallel_busiest_pairs", 0)
    routed = stats.get("expert_parallel_routed_pairs", 0)
    return routed / (world_size * busiest) if busiest else None


def expert_map(num_experts: int, held: list[int], device: torch.device) -> torch.Tensor:
    """Global expert id -> this rank's index of it, -1 for another rank's (int64)."""
    table = torch.full((num_experts,), -1, dtype=torch.int64)
    table[torch.tensor(held, dtype=torch.int64)] = torch.arange(len(held), dtype=torch.int64)
    return table.to(device)
