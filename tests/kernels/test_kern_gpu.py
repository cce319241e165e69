"""GPU checks: compiled Triton kernels and flash-attn against the oracle.

Skipped without CUDA. Run on a GPU box with ``bash bench/gpu_check.sh``
(TRITON_INTERPRET unset there, so Triton compiles real kernels).
"""

import importlib.util

import pytest
import torch

from pagedserve.kernels import available_backends, get_backend
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, mixed_lengths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _backends() -> list[str]:
    return available_backends("cuda") if torch.cuda.is_available() else []


def _cases(name: str) -> list[tuple[torch.dtype, int]]:
    """(dtype, block size) pairs a backend supports."""
    if name == "flash":
        return [(torch.float16, 256), (torch.bfloat16, 256)]
    return [(torch.float32, 16), (torch.float16, 16), (torch.bfloat16, 32), (torch.float32, 256)]


@pytest.mark.parametrize("name", ["torch", "triton", "flash"])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_backend_matches_oracle(name: str, gqa: int, head_dim: int) -> None:
    if name not in _backends():
        pytest.skip(f"{name} unavailable on this CUDA box")
    be = get_backend(name, "cuda")
    for dtype, bsz in _cases(name):
        for decode in (False, True):
            q_lens, k_lens = mixed_lengths(bsz, gqa + head_dim)
            if decode:
                q_lens, k_lens = [1] * len(k_lens), [*k_lens[:-1], 0]
            b = make_paged_batch(
                q_lens, k_lens, 2 * gqa, 2, head_dim, bsz, dtype=dtype,
                device="cuda", garbage=3.0, seed=gqa,
            )
            check_against_oracle(be, b, GPU_TOL[dtype], decode=decode, device="cuda")


def test_gpu_triton_long_decode_uses_split_k() -> None:
    if "triton" not in _backends():
        pytest.skip("triton unavailable")
    from pagedserve.kernels.triton_backend import TritonBackend

    be = TritonBackend("cuda")
    k_lens = [4000, 1, 2500, 17]
    assert be._splits(len(k_lens) * 2, 4096, 16) > 1
    b = make_paged_batch([1] * 4, k_lens, 8, 2, 128, 16, device="cuda", garbage=3.0)
    check_against_oracle(be, b, GPU_TOL[torch.float32], decode=True, device="cuda")


def test_gpu_triton_decode_fills_a_short_grid_with_split_k() -> None:
    """A decode grid of 1.5 waves (64 sequences x 3 KV heads on an H200) at long
    contexts: the default launch splits K (two stages once the split grid fills the
    GPU) and still matches the oracle, ragged lengths and empty splits included."""
    if "triton" not in _backends():
        pytest.skip("triton unavailable")
    from pagedserve.kernels.triton_backend import TritonBackend

    be = TritonBackend("cuda")
    hkv, block_size = 3, 16
    seqs = -(-3 * be._sms() // (2 * hkv))
    g = torch.Generator().manual_seed(7)
    k_lens = (4096 - torch.randint(0, 4000, (seqs,), generator=g)).tolist()
    k_lens[0], k_lens[1] = 4096, 1
    b = make_paged_batch([1] * seqs, k_lens, 3 * hkv, hkv, 64, block_size,
                         dtype=torch.float16, device="cuda", extra_blocks=0, garbage=3.0)
    splits = be._splits(seqs * hkv, b.block_table.shape[1] * block_size, 16)
    assert splits == 4 and be._stages(seqs * hkv, splits, 16) == {"num_stages": 2}
    check_against_oracle(be, b, GPU_TOL[torch.float16], decode=True, device="cuda")


@pytest.mark.parametrize("name", ["torch", "triton", "flash"])
def test_gpu_cache_ops(name: str) -> None:
    if name not in _backends():
        pytest.skip(f"{name} unavailable on this CUDA box")
    be = get_backend(name, "cuda")
    shape = (8, 256, 2, 64)
    kc = torch.randn(shape, device="cuda", dtype=torch.float16)
    vc = torch.randn(shape, device="cuda", dtype=torch.float16)
    key = torch.randn(4, 2, 64, device="cuda", dtype=torch.float16)
    slots = torch.tensor([5, -1, 300, 2047], device="cuda")
    before = kc.clone()
    be.store_kv(key, key, kc, vc, slots)
    flat = kc.view(-1, 2, 64)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[2047], key[3])
    changed = (kc != before).any(-1).any(-1).view(-1).nonzero().view(-1).tolist()
    assert set(changed) <= {5, 300, 2047}
    pairs = torch.tensor([[1, 6], [2, 7]])
    be.copy_blocks([kc], [vc], pairs)
    assert torch.equal(kc[6], kc[1]) and torch.equal(vc[7], vc[2])
    cpu = torch.zeros((4, 256, 2, 64), dtype=torch.float16)
    be.swap_blocks([kc], [cpu], torch.tensor([[6, 3]]))
    assert torch.equal(cpu[3], kc[6].cpu())


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn missing")
def test_flash_block_size_rule() -> None:
    be = get_backend("flash", "cuda")
    assert be.supports_block_size(256) and be.supports_block_size(512)
    assert not be.supports_block_size(16)


@pytest.mark.parametrize("name", ["torch", "triton", "flash"])
@pytest.mark.parametrize("window", [1, 17, 300, 4096])
def test_gpu_sliding_window_matches_oracle(name: str, window: int) -> None:
    """Sliding windows through the compiled kernels (flash-attn: ``window_size``), mixed
    and decode batches, and long decode rows whose split-K covers only the window."""
    if name not in _backends():
        pytest.skip(f"{name} unavailable on this CUDA box")
    be = get_backend(name, "cuda")
    for dtype, bsz in _cases(name):
        q_lens, k_lens = mixed_lengths(bsz, window)
        b = make_paged_batch(q_lens, k_lens, 8, 2, 128, bsz, dtype=dtype, device="cuda",
                             garbage=3.0, seed=window)
        check_against_oracle(be, b, GPU_TOL[dtype], decode=False, device="cuda",
                             window=window)
        k_lens = [5000, 1, 2500, 17, 300]
        b = make_paged_batch([1] * 5, k_lens, 8, 2, 128, bsz, dtype=dtype, device="cuda",
                             garbage=3.0, seed=window + 1)
        check_against_oracle(be, b, GPU_TOL[dtype], decode=True, device="cuda",
                             window=window)
