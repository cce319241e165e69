"""Mamba-2's one-token state update on CPU in one native call (``cpu_mamba.c``), and
Mamba-1's, one token for a batch and a whole prompt (``layers.mamba1``).

Why: a decode step's cost in a Mamba layer is its SSM state (heads x head_dim x
d_state fp32 numbers a sequence); torch gathers the batch's slots, passes over the
copy to decay it, add the outer product and contract it with C, then scatters it
back. The kernel updates each slot where it lies, one read and one write, and
yields ``y`` in the same pass (``bench/moe.py --kind granitemoehybrid``).
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native


def available(ssm: torch.Tensor) -> bool:
    """Whether the kernel takes this state tensor (fp32, contiguous, on the CPU). Asked
    by every Mamba layer of every decode step: the library is looked up without
    ``load``'s lock once it has been tried."""
    return (ssm.device.type == "cpu" and ssm.dtype == torch.float32 and ssm.is_contiguous()
            and cpu_native._loaded() is not None)


def state_update(ssm: torch.Tensor, slots: torch.Tensor, da: torch.Tensor, xdt: torch.Tensor,
                 b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``ssm[slots] = ssm[slots] * da + xdt (outer) b`` in place, and ``y = state @ c``.

    ``ssm [slots, H, P, N]``, ``slots [n]`` (int64), ``da [n, H]``, ``xdt [n, H, P]``,
    ``b`` and ``c [n, H, N]``, all fp32; returns ``y [n, H, P]``."""
    num_slots, heads, p, d_state = ssm.shape
    n = slots.shape[0]
    slots = slots.to(torch.int64).contiguous()
    da, xdt, b, c = (t.float().contiguous() for t in (da, xdt, b, c))
    if (tuple(da.shape) != (n, heads) or tuple(xdt.shape) != (n, heads, p)
            or tuple(b.shape) != (n, heads, d_state) or tuple(c.shape) != b.shape):
        raise ValueError(f"Mamba kernel: state {tuple(ssm.shape)} does not fit inputs "
                         f"{tuple(da.shape)} / {tuple(xdt.shape)} / {tuple(b.shape)}")
    y = torch.empty((n, heads, p), dtype=torch.float32)
    rc = cpu_native._loaded().mamba_state_update(
        ssm.data_ptr(), num_slots, slots.data_ptr(), n, heads, p, d_state, da.data_ptr(),
        xdt.data_ptr(), b.data_ptr(), c.data_ptr(), y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"Mamba kernel: a slot of {slots.tolist()} is out of [0, {num_slots})")
    return y


def mamba1_state_update(ssm: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                        dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
                        ) -> torch.Tensor:
    """Mamba-1's ``ssm[slots] = ssm[slots] * exp(dt A) + dt x (outer) b`` in place, and
    ``y = state @ c``.

    ``ssm [slots, D, N]``, ``slots [n]`` (int64), ``x`` and ``dt [n, D]``, ``a [D,
    N]`` (negative), ``b`` and ``c [n, N]``, all fp32; returns ``y [n, D]``."""
    num_slots, width, d_state = ssm.shape
    n = slots.shape[0]
    slots = slots.to(torch.int64).contiguous()
    x, dt, a, b, c = (t.float().contiguous() for t in (x, dt, a, b, c))
    if (tuple(x.shape) != (n, width) or dt.shape != x.shape
            or tuple(a.shape) != (width, d_state) or tuple(b.shape) != (n, d_state)
            or c.shape != b.shape):
        raise ValueError(f"Mamba-1 kernel: state {tuple(ssm.shape)} does not fit inputs "
                         f"{tuple(x.shape)} / {tuple(a.shape)} / {tuple(b.shape)}")
    y = torch.empty((n, width), dtype=torch.float32)
    rc = cpu_native._loaded().mamba1_state_update(
        ssm.data_ptr(), num_slots, slots.data_ptr(), n, width, d_state, dt.data_ptr(),
        x.data_ptr(), a.data_ptr(), b.data_ptr(), c.data_ptr(), y.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"Mamba-1 kernel: a slot of {slots.tolist()} is out of "
                         f"[0, {num_slots})")
    return y


def mamba1_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's scan of one sequence, token by token in one native pass (the contract
    of ``layers.mamba1.selective_scan``): ``x`` and ``dt [L, D]``, ``a [D, N]``, ``b``
    and ``c [L, N]``, ``h0 [D, N]``, fp32; returns ``y [L, D]`` and the last state."""
    length, width = x.shape
    d_state = a.shape[1]
    if (dt.shape != x.shape or tuple(a.shape) != (width, d_state)
            or tuple(b.shape) != (length, d_state) or c.shape != b.shape
            or tuple(h0.shape) != (width, d_state)):
        raise ValueError(f"Mamba-1 scan: inputs {tuple(x.shape)} / {tuple(a.shape)} / "
                         f"{tuple(b.shape)} / {tuple(h0.shape)} do not fit")
    h = h0.float().clone().contiguous()
    xt, dtt = x.float().t().contiguous(), dt.float().t().contiguous()  # (channel-major)
    a, b, c = (t.float().contiguous() for t in (a, b, c))
    y = torch.empty((width, length), dtype=torch.float32)
    cpu_native._loaded().mamba1_scan(
        h.data_ptr(), length, width, d_state, dtt.data_ptr(), xt.data_ptr(), a.data_ptr(),
        b.data_ptr(), c.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y.t(), h


def conv_available(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> bool:
    """Whether ``conv_update`` takes these tensors: on the CPU, all fp32 or all bf16,
    the state, weight and bias contiguous, ``x`` rows of unit stride (a column slice of
    a projection's output is fine)."""
    return (conv.device.type == "cpu" and conv.dtype in (torch.float32, torch.bfloat16)
            and x.dim() == 2 and x.dtype == conv.dtype == weight.dtype
            and (bias is None or (bias.dtype == conv.dtype and bias.is_contiguous()))
            and conv.is_contiguous() and weight.is_contiguous() and x.stride(-1) == 1
            and cpu_native._loaded() is not None)


def conv_update(x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal convolution's one-token step (``layers.causal_conv.conv_decode``'s
    contract) in one native pass: ``x [n, C]``, ``conv [S, C, kernel - 1]`` shifted
    in place at ``slots``, ``weight [C, kernel]``; returns ``[n, C]``."""
    num_slots, channels, keep = conv.shape
    n = slots.shape[0]
    slots = slots.to(torch.int64).contiguous()
    if tuple(x.shape) != (n, channels) or tuple(weight.shape) != (channels, keep + 1):
        raise ValueError(f"convolution kernel: state {tuple(conv.shape)} does not fit "
                         f"inputs {tuple(x.shape)} / weight {tuple(weight.shape)}")
    out = torch.empty((n, channels), dtype=conv.dtype)
    rc = cpu_native._loaded().conv_state_update(
        x.data_ptr(), x.stride(0), conv.data_ptr(), num_slots, slots.data_ptr(), n, channels,
        keep + 1, weight.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), int(conv.dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"convolution kernel: a slot of {slots.tolist()} is out of "
                         f"[0, {num_slots})")
    return out
