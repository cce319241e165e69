"""The native delta-rule update (``kernels/cpu_deltanet.c``) against torch's math, in
place in scattered slots; and a DeltaNet layer's decode through it equal to its
torch path."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_deltanet, cpu_native
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.worker.deltanet_config import DeltaNetConfig
from pagedserve.worker.layers.gated_deltanet import GatedDeltaNet
from pagedserve.worker.mamba_state import states_for
from pagedserve.worker.parallel import ParallelContext

pytestmark = pytest.mark.skipif(cpu_native.load() is None,
                                reason="no C compiler: native CPU kernels off")


@pytest.mark.parametrize("heads,dk,dv", [(3, 4, 5), (4, 16, 8), (2, 128, 128)])
def test_kernel_updates_the_slots_it_names_and_only_them(heads, dk, dv) -> None:
    g = torch.Generator().manual_seed(heads * dk)
    state = torch.randn(9, heads, dk, dv, generator=g)
    slots = torch.tensor([7, 2, 4])
    decay, beta = torch.rand(3, heads, generator=g), torch.rand(3, heads, generator=g)
    q, k = (torch.randn(3, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(3, heads, dv, generator=g)
    s = state[slots] * decay[..., None, None]
    delta = (v - torch.einsum("shk,shkv->shv", k, s)) * beta[..., None]
    want_state = s + k[..., None] * delta[:, :, None, :]
    want_out = torch.einsum("shk,shkv->shv", q, want_state)
    before = state.clone()
    out = cpu_deltanet.update(state, slots, decay, beta, q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state[slots], want_state, atol=1e-5, rtol=1e-5)
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(state[others], before[others])
    with pytest.raises(ValueError, match="out of"):
        cpu_deltanet.update(state, torch.tensor([9, 0, 1]), decay, beta, q, k, v)


@pytest.mark.parametrize("split_proj", [False, True])
def test_layer_decode_equals_its_torch_path(monkeypatch, split_proj) -> None:
    """A prompt step then two decode steps of four sequences, with the kernel and with
    ``cpu_deltanet`` off (the gather / update / scatter path): the same outputs."""
    dc = DeltaNetConfig((0,), (), num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                        d_conv=4, split_proj=split_proj)
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, dc, 1e-6, ParallelContext(), torch.float32,
                          torch.device("cpu"))
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3)
    model = torch.nn.Module()
    model.mamba_mixers = lambda: [layer]
    x = torch.randn(4 * 6 + 2 * 4, 32)

    def run() -> list[torch.Tensor]:
        states = states_for(model, 8)
        states.step([ScheduledRequest("pad", [0], 0, [], ["pad"], {})])  # (slot 0 taken)
        outs, rows = [], 0
        for start, n in ((0, 6), (6, 1), (7, 1)):
            reqs = [ScheduledRequest(f"r{i}", [0] * n, start, [], [f"r{i}"], {})
                    for i in (3, 0, 2, 1)]
            outs.append(layer(x[rows:rows + 4 * n], states.step(reqs)))
            rows += 4 * n
        return outs

    native = run()
    monkeypatch.setattr(cpu_deltanet, "available", lambda state: False)
    for got, want in zip(native, run(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
