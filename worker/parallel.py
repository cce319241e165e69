"""Tensor-parallel context: which rank we are and how to talk to the others.

There is no module-level process group: every layer receives the
``ParallelContext`` it needs. That keeps two engines (or a TP=1 and a TP=2
model in one test) in one process from stepping on each other, and lets a
world size of 1 run without ever touching ``torch.distributed``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


@dataclass
class ParallelContext:
    """Rank, world size and process group of one tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    # Set by ``worker.batch_invariant``: sums add every element's partials in rank
    # order (see ``all_reduce``), whatever the tensor's size.
    fixed_order: bool = False
    # Routed experts held whole, a share per rank, instead of a slice of every one
    # (``layers.expert_placement``; set by the worker from its config).
    expert_parallel: bool = False
    expert_placement: str = "linear"

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place; a no-op at world size 1.

        Two ranks' partials add in one order (fp addition commutes). Over more, a ring
        all-reduce adds an element's partials in an order set by where the tensor's
        chunks split, which moves with its number of rows; with ``fixed_order`` every
        rank gathers all partials and adds them rank by rank instead (world-size times
        the bytes, so only where a row's bits must not depend on the batch).
        """
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        if self.fixed_order and self.world_size > 2:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0; others get None.

        Used for vocab-parallel logits: only rank 0 samples, so the other
        ranks never need the full vocabulary.
        """
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.gather(x, gather_list=parts, dst=0, group=self.group)
            return torch.cat(parts, dim=-1)
        dist.gather(x, dst=0, group=self.group)
        return None

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)


def init_parallel(
    rank: int,
    world_size: int,
    init_method: str | None,
    device: torch.device,
    timeout_s: float = 300.0,
) -> ParallelContext:
    """Join the TP group (gloo on CPU, nccl on CUDA); world size 1 skips torch.distributed.

    A rank that was already initialised in this process (e.g. a restarted
    worker) reuses the default group rather than failing.
    """
    if world_size == 1:
        return ParallelContext(0, 1, None)
    import torch.distributed as dist

    if init_method is None:
        raise ValueError("init_method is required when world_size > 1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
    return ParallelContext(rank, world_size, dist.group.WORLD)


def destroy_parallel(ctx: ParallelContext) -> None:
    """Leave the process group so a new one can be formed (e.g. after a peer died)."""
    if ctx.world_size == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def get_node_ip_and_free_port() -> tuple[str, int]:
    """This node's routable IP and a free TCP port, for ``tcp://ip:port`` on rank 0.

    The port is found by binding port 0 and releasing it; the small race until
    torch binds it is acceptable because ranks start within seconds.
    """
    ip = _node_ip()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ip, port


def _node_ip() -> str:
    """Ray's address for this node when inside Ray (ranks may span nodes); otherwise
    loopback, since ranks started without Ray are local processes."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"
