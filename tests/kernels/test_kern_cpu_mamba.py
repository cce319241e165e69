"""The native Mamba-2 state update (``kernels/cpu_mamba.c``) against torch's math, in
place in scattered slots; a mixer's decode through it equal to its torch path;
Mamba-1's update and scan against ``layers.mamba1``'s torch paths; and the causal
convolution's one-token step against ``layers.causal_conv``'s."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_mamba, cpu_native
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.worker.layers import causal_conv, mamba1
from pagedserve.worker.layers.mamba2 import Mamba2Mixer
from pagedserve.worker.mamba_config import MambaConfig
from pagedserve.worker.mamba_state import states_for
from pagedserve.worker.parallel import ParallelContext

pytestmark = pytest.mark.skipif(cpu_native.load() is None,
                                reason="no C compiler: native CPU kernels off")


@pytest.mark.parametrize("heads,p,n", [(3, 4, 5), (8, 16, 16), (2, 64, 128)])
def test_kernel_updates_the_slots_it_names_and_only_them(heads, p, n) -> None:
    g = torch.Generator().manual_seed(heads * p)
    ssm = torch.randn(9, heads, p, n, generator=g)
    slots = torch.tensor([7, 2, 4])
    da = torch.rand(3, heads, generator=g)
    xdt, b, c = (torch.randn(3, heads, k, generator=g) for k in (p, n, n))
    want_state = ssm[slots] * da[..., None, None] + xdt[..., None] * b[:, :, None, :]
    want_y = torch.einsum("shpn,shn->shp", want_state, c)
    before = ssm.clone()
    y = cpu_mamba.state_update(ssm, slots, da, xdt, b, c)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm[slots], want_state, atol=1e-6, rtol=1e-6)
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(ssm[others], before[others])
    with pytest.raises(ValueError, match="out of"):
        cpu_mamba.state_update(ssm, torch.tensor([9, 0, 1]), da, xdt, b, c)


def test_mixer_decode_equals_its_torch_path(monkeypatch) -> None:
    """A prompt step then two decode steps of four sequences, with the kernel and with
    ``cpu_mamba`` off (the gather / update / scatter path): the same outputs."""
    mc = MambaConfig((0,), (), num_heads=4, head_dim=8, d_state=16, num_groups=2, d_conv=4,
                     chunk_size=4, conv_bias=True, proj_bias=False)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(32, mc, 1e-5, ParallelContext(), torch.float32, torch.device("cpu"),
                        0)
    for p in mixer.parameters():
        p.data.normal_(0.0, 0.3)
    model = torch.nn.Module()
    model.mamba_mixers = lambda: [mixer]
    x = torch.randn(4 * 6 + 2 * 4, 32)

    def run() -> list[torch.Tensor]:
        states = states_for(model, 8)
        states.step([ScheduledRequest("pad", [0], 0, [], ["pad"], {})])  # (slot 0 taken)
        outs, rows = [], 0
        for start, q in ((0, 6), (6, 1), (7, 1)):
            reqs = [ScheduledRequest(f"r{i}", [0] * q, start, [], [f"r{i}"], {})
                    for i in (3, 0, 2, 1)]
            outs.append(mixer(x[rows:rows + 4 * q], states.step(reqs)))
            rows += 4 * q
        return outs

    native = run()
    monkeypatch.setattr(cpu_mamba, "available", lambda ssm: False)
    for got, want in zip(native, run(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mamba1_kernels_equal_torch(monkeypatch) -> None:
    """Mamba-1's one-token update in scattered slots (only them touched) and its
    whole-sequence scan against the torch paths of ``layers.mamba1``."""
    g = torch.Generator().manual_seed(1)
    width, n = 24, 16
    a = -torch.rand(width, n, generator=g) * 3
    ssm = torch.randn(9, width, n, generator=g)
    slots = torch.tensor([7, 2, 4])
    x, dt = torch.randn(3, width, generator=g), torch.rand(3, width, generator=g)
    b, c = torch.randn(3, n, generator=g), torch.randn(3, n, generator=g)
    want = ssm.clone()
    with monkeypatch.context() as m:
        m.setattr(cpu_mamba, "available", lambda ssm: False)
        want_y = mamba1._state_update(want, slots, x, dt, a, b, c)
    got = ssm.clone()
    torch.testing.assert_close(cpu_mamba.mamba1_state_update(got, slots, x, dt, a, b, c),
                               want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="out of"):
        cpu_mamba.mamba1_state_update(got, torch.tensor([9, 0, 1]), x, dt, a, b, c)
    length = 37
    x, dt = torch.randn(length, width, generator=g), torch.rand(length, width, generator=g)
    b, c = torch.randn(length, n, generator=g), torch.randn(length, n, generator=g)
    h0 = torch.randn(width, n, generator=g)
    y, final = cpu_mamba.mamba1_scan(x, dt, a, b, c, h0)
    want_y, want_final = mamba1.selective_scan(x, dt, a, b, c, h0, chunk=8)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,bias,kernel", [(torch.float32, True, 4),
                                               (torch.bfloat16, False, 3)])
def test_conv_step_equals_torch(dtype, bias, kernel, monkeypatch) -> None:
    """The causal convolution's one-token step in scattered slots, from a column slice
    of a wider projection (rows not contiguous), against the torch path."""
    g = torch.Generator().manual_seed(kernel)
    wide = torch.randn(3, 200, generator=g).to(dtype)
    x = wide[:, 30:160]  # (130 channels: three blocks of the kernel's 64)
    conv = torch.randn(9, 130, kernel - 1, generator=g).to(dtype)
    weight = torch.randn(130, kernel, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype) if bias else None
    slots = torch.tensor([7, 2, 4])
    assert cpu_mamba.conv_available(x, conv, weight, b)
    got_state = conv.clone()
    got = causal_conv.conv_decode(x, got_state, slots, weight, b)
    monkeypatch.setattr(cpu_mamba, "conv_available", lambda *a: False)
    want_state = conv.clone()
    want = causal_conv.conv_decode(x, want_state, slots, weight, b)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got_state, want_state)  # (the shift moves numbers: exact)
    with pytest.raises(ValueError, match="out of"):
        cpu_mamba.conv_update(x, got_state, torch.tensor([9, 0, 1]), weight, b)
