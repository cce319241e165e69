"""GPU checks of the Triton kernels over narrow KV caches (fp16 / bf16 / fp8).

Skipped without CUDA; ``bash bench/gpu_check.sh`` runs this file after the
core GPU tests, so its extra compiles cannot crowd them out of the window.
"""

import pytest
import torch

from pagedserve.kernels import get_backend
from pagedserve.kernels.kv_quant import kv_dtype_name, quantize, storage_view
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, mixed_lengths
from tests.kernels.test_kern_gpu import GPU_TOL, _backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (model dtype, kv_cache_dtype): the oracle reads the dequantised cache, so the model
# dtype's tolerance holds; fp8 under 16-bit models takes the tensor-core path.
NARROW_KV = [
    (torch.float16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
]
NARROW_IDS = [f"{kv_dtype_name(m)}-{kv_dtype_name(kv)}" for m, kv in NARROW_KV]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]



@pytest.mark.parametrize(("dtype", "kv_dtype"), NARROW_KV, ids=NARROW_IDS)
@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 64), (4, 128)])
def test_gpu_triton_narrow_kv_cache(dtype: torch.dtype, kv_dtype: torch.dtype, gqa: int,
                                    head_dim: int) -> None:
    if "triton" not in _backends():
        pytest.skip("triton unavailable")
    be = get_backend("triton", "cuda")
    for decode in (False, True):
        q_lens, k_lens = mixed_lengths(16, gqa + head_dim)
        if decode:
            q_lens, k_lens = [1] * len(k_lens), [*k_lens[:-1], 0]
        b = make_paged_batch(
            q_lens, k_lens, 2 * gqa, 2, head_dim, 16, dtype=dtype, device="cuda",
            garbage=3.0, seed=gqa, kv_dtype=kv_dtype,
        )
        assert b.key_cache.dtype == kv_dtype
        check_against_oracle(be, b, GPU_TOL[dtype], decode=decode, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", FP8, ids=[kv_dtype_name(d) for d in FP8])
def test_gpu_triton_split_k_over_fp8_cache(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    if "triton" not in _backends():
        pytest.skip("triton unavailable")
    from pagedserve.kernels.triton_backend import TritonBackend

    be = TritonBackend("cuda", num_splits=4)
    b = make_paged_batch([1] * 4, [3000, 1, 700, 17], 8, 2, 128, 16, dtype=dtype,
                         device="cuda", garbage=3.0, kv_dtype=kv_dtype)
    check_against_oracle(be, b, GPU_TOL[dtype], decode=True, device="cuda")


@pytest.mark.parametrize("kv_dtype", FP8, ids=[kv_dtype_name(d) for d in FP8])
def test_gpu_triton_fp8_cache_ops(kv_dtype: torch.dtype) -> None:
    if "triton" not in _backends():
        pytest.skip("triton unavailable")
    be = get_backend("triton", "cuda")
    shape = (8, 16, 2, 64)
    kc = quantize(torch.randn(shape, device="cuda") * 10, kv_dtype)
    vc = quantize(torch.randn(shape, device="cuda"), kv_dtype)
    key = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16) * 100
    key[0, 0, :4] = torch.tensor([1e5, -1e5, 3e-3, 3e-5], device="cuda")  # saturate; subnormals
    slots = torch.tensor([5, -1, 30, 127], device="cuda")
    before = storage_view(kc).clone()
    be.store_kv(key, key, kc, vc, slots)
    flat = storage_view(kc).view(-1, 2, 64)
    for t, s in ((0, 5), (2, 30), (3, 127)):
        assert torch.equal(flat[s], storage_view(quantize(key[t], kv_dtype)))
        assert torch.equal(storage_view(vc).view(-1, 2, 64)[s], flat[s])
    assert torch.isfinite(kc.float()).all()
    changed = (storage_view(kc) != before).any(-1).any(-1).view(-1).nonzero().view(-1).tolist()
    assert set(changed) <= {5, 30, 127}
    be.copy_blocks([kc], [vc], torch.tensor([[1, 6], [2, 7]]))
    assert torch.equal(storage_view(kc[6]), storage_view(kc[1]))
    assert torch.equal(storage_view(vc[7]), storage_view(vc[2]))
