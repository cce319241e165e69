"""store_kv, copy_blocks, swap_blocks and backend selection."""

import importlib.util

import pytest
import torch

from pagedserve.kernels import AttentionBackend, available_backends, get_backend

CPU_BACKENDS = available_backends("cpu")


def _caches(num_blocks: int = 6, block_size: int = 4, hkv: int = 2, d: int = 8, layers: int = 2):
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, hkv, d)
    return (
        [torch.randn(shape, generator=g) for _ in range(layers)],
        [torch.randn(shape, generator=g) for _ in range(layers)],
    )


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_store_kv_skips_padding_slots(name: str) -> None:
    be = get_backend(name, "cpu")
    (kc,), (vc,) = _caches(layers=1)
    k0, v0 = kc.clone(), vc.clone()
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    slots = torch.tensor([7, -1, 0, 23, -1], dtype=torch.long)
    be.store_kv(key, value, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[t]) and torch.equal(flat_v[s], value[t])
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[[7, 0, 23]] = False
    assert torch.equal(flat_k[untouched], k0.view(-1, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], v0.view(-1, 2, 8)[untouched])


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_store_kv_all_padding_and_empty(name: str) -> None:
    be = get_backend(name, "cpu")
    (kc,), (vc,) = _caches(layers=1)
    k0 = kc.clone()
    be.store_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), kc, vc, torch.full((3,), -1))
    be.store_kv(torch.randn(0, 2, 8), torch.randn(0, 2, 8), kc, vc, torch.zeros(0, dtype=torch.long))
    assert torch.equal(kc, k0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_copy_blocks_all_layers(name: str) -> None:
    be = get_backend(name, "cpu")
    kcs, vcs = _caches()
    before_k = [c.clone() for c in kcs]
    before_v = [c.clone() for c in vcs]
    pairs = torch.tensor([[0, 3], [2, 5], [0, 1]], dtype=torch.long)
    be.copy_blocks(kcs, vcs, pairs)
    for layer in range(2):
        for src, dst in pairs.tolist():
            assert torch.equal(kcs[layer][dst], before_k[layer][src])
            assert torch.equal(vcs[layer][dst], before_v[layer][src])
        for blk in (0, 2, 4):
            assert torch.equal(kcs[layer][blk], before_k[layer][blk])
    be.copy_blocks(kcs, vcs, torch.zeros(0, 2, dtype=torch.long))


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_swap_blocks_between_pools_of_different_size(name: str) -> None:
    be = get_backend(name, "cpu")
    dev_k, dev_v = _caches(num_blocks=6)
    cpu_k, cpu_v = _caches(num_blocks=10)
    orig = [c.clone() for c in dev_k]
    out_pairs = torch.tensor([[1, 9], [4, 0]], dtype=torch.long)
    be.swap_blocks(dev_k + dev_v, cpu_k + cpu_v, out_pairs)
    for layer in range(2):
        assert torch.equal(cpu_k[layer][9], dev_k[layer][1])
        assert torch.equal(cpu_v[layer][0], dev_v[layer][4])
    for c in dev_k:
        c.zero_()
    in_pairs = torch.tensor([[9, 2], [0, 5]], dtype=torch.long)
    be.swap_blocks(cpu_k, dev_k, in_pairs)
    for layer in range(2):
        assert torch.equal(dev_k[layer][2], orig[layer][1])
        assert torch.equal(dev_k[layer][5], orig[layer][4])
        assert dev_k[layer][0].abs().sum() == 0


def test_swap_rejects_mismatched_block_shapes() -> None:
    be = get_backend("torch")
    a, _ = _caches(block_size=4, layers=1)
    b, _ = _caches(block_size=8, layers=1)
    with pytest.raises(ValueError, match="block shapes"):
        be.swap_blocks(a, b, torch.tensor([[0, 0]]))


def test_default_backend_on_cpu_is_native_else_torch() -> None:
    be = get_backend()
    assert isinstance(be, AttentionBackend)
    assert be.name == ("cpu" if "cpu" in available_backends("cpu") else "torch")
    assert be.supports_block_size(16) and be.supports_block_size(1)
    assert "torch" in available_backends("cpu")


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("cuda-magic")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_explicit_flash_on_cpu_says_why() -> None:
    with pytest.raises(RuntimeError, match="flash-attn needs a CUDA device"):
        get_backend("flash", "cpu")
    assert "flash" not in available_backends("cpu")


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="needs triton and no CUDA",
)
def test_triton_on_cpu_without_interpreter_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        get_backend("triton", "cpu")
    assert "triton" not in available_backends("cpu")


def test_triton_imported_before_interpreter_flag_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Interpreted kernels cannot call triton.language helpers compiled at import."""
    from pagedserve.kernels import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "_has_module", lambda name: True)
    monkeypatch.setattr(backend, "_triton_imported_without_interpreter", lambda: True)
    assert "triton" not in available_backends("cpu")
    with pytest.raises(RuntimeError, match="imported before TRITON_INTERPRET"):
        get_backend("triton", "cpu")
