"""The gated delta rule's one-token update on CPU in one native call
(``cpu_deltanet.c``).

Why: a decode step's cost in a gated DeltaNet layer is its state (value heads x key
dim x value dim fp32 numbers a sequence); torch gathers the batch's slots, passes
over the copy to decay it, read ``k^T S``, add the outer product and read ``q^T
S``, then scatters it back. The kernel updates each slot where it lies and yields
the output in the same two cached passes (``bench/moe.py --kind qwen3_next``).
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native

DV_MAX = 1024  # (the kernel's row buffer: ``cpu_deltanet.c``)


def available(state: torch.Tensor) -> bool:
    """Whether the kernel takes this state tensor (fp32, contiguous, on the CPU, value
    dim within its buffer). Asked by every DeltaNet layer of every decode step: the
    library is looked up without ``load``'s lock once it has been tried."""
    return (state.device.type == "cpu" and state.dtype == torch.float32
            and state.is_contiguous() and state.shape[-1] <= DV_MAX
            and cpu_native._loaded() is not None)


def update(state: torch.Tensor, slots: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One delta-rule step of ``state[slots]`` in place: decay by ``decay``, write
    ``k (outer) beta (v - k^T S)``; returns ``q^T S`` after it.

    ``state [slots, H, dk, dv]``, ``slots [n]`` (int64), ``decay`` and ``beta [n, H]``,
    ``q`` and ``k [n, H, dk]``, ``v [n, H, dv]``, all fp32; returns ``[n, H, dv]``."""
    num_slots, heads, dk, dv = state.shape
    n = slots.shape[0]
    slots = slots.to(torch.int64).contiguous()
    decay, beta, q, k, v = (t.float().contiguous() for t in (decay, beta, q, k, v))
    if (tuple(decay.shape) != (n, heads) or beta.shape != decay.shape
            or tuple(q.shape) != (n, heads, dk) or k.shape != q.shape
            or tuple(v.shape) != (n, heads, dv)):
        raise ValueError(f"DeltaNet kernel: state {tuple(state.shape)} does not fit inputs "
                         f"{tuple(decay.shape)} / {tuple(q.shape)} / {tuple(v.shape)}")
    out = torch.empty((n, heads, dv), dtype=torch.float32)
    rc = cpu_native._loaded().delta_rule_update(
        state.data_ptr(), num_slots, slots.data_ptr(), n, heads, dk, dv, decay.data_ptr(),
        beta.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"DeltaNet kernel: a slot of {slots.tolist()} is out of "
                         f"[0, {num_slots})")
    return out
