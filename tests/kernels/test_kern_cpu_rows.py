"""The "cpu" backend's native prefill rows and native store.

Short prefills run as native decode rows (one per query, keys up to its own
position); long ones keep SDPA. These check both sides of that split in one
batch against the dense oracle, that the per-step row plan is rebuilt when
the metadata or block table changes, the fallbacks, and that the one-call
store writes exactly what the torch store writes (narrow caches included).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import available_backends, cpu_backend, cpu_native, get_backend
from pagedserve.kernels.metadata import build_varlen_metadata
from pagedserve.kernels.testing import check_against_oracle, make_paged_batch, slots_for
from pagedserve.kernels.torch_ref import TorchBackend, store_kv_torch

pytestmark = pytest.mark.skipif(
    "cpu" not in available_backends("cpu"), reason="no C compiler for the native kernel"
)
FP32_TOL = 1e-5
LONG = cpu_backend.ROWS_MAX_KEYS + 37


def _count_sdpa_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the sequence ids of every SDPA prefill group the backend runs."""
    seen: list[int] = []
    original = TorchBackend._prefill_group

    def spy(self, q, kc, vc, table, ids, *rest):
        seen.extend(ids)
        return original(self, q, kc, vc, table, ids, *rest)

    monkeypatch.setattr(TorchBackend, "_prefill_group", spy)
    return seen


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
def test_mixed_batch_splits_rows_and_sdpa(monkeypatch: pytest.MonkeyPatch, heads: int,
                                          kv_heads: int, head_dim: int) -> None:
    # decode rows (one long), no-context and chunked short prefills, a key-less row,
    # block-size edges, and one long prefill of each kind for SDPA.
    q_lens = [1, 1, 40, 17, 16, 5, 3, LONG, 30]
    k_lens = [9, LONG + 500, 40, 17, 33, 0, 190, LONG, LONG + 64]
    b = make_paged_batch(q_lens, k_lens, heads, kv_heads, head_dim, 16, seed=head_dim)
    groups = _count_sdpa_groups(monkeypatch)
    check_against_oracle(get_backend("cpu"), b, FP32_TOL, decode=False)
    assert sorted(groups) == [7, 8]  # only the long prefills went to SDPA


def test_all_short_prefills_skip_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q_lens = [12, 40, 1, 64, 7]
    k_lens = [12, 40, 80, 64, 20]
    b = make_paged_batch(q_lens, k_lens, 9, 3, 64, 16, seed=1)
    groups = _count_sdpa_groups(monkeypatch)
    check_against_oracle(get_backend("cpu"), b, FP32_TOL, decode=False)
    assert groups == []


def test_row_plan_follows_the_metadata_and_block_table() -> None:
    """Layers reuse one step's row plan; a new step (metadata) or a different block
    table gets a new one."""
    be = get_backend("cpu")
    a = make_paged_batch([10, 3], [10, 30], 9, 3, 64, 16, seed=2)
    c = make_paged_batch([5, 20, 1], [25, 20, 7], 9, 3, 64, 16, seed=3)
    for batch in (a, c, a):
        check_against_oracle(be, batch, FP32_TOL, decode=False)
    md = build_varlen_metadata(a.query_lens, a.key_lens)
    first = be.varlen_attention(a.q, a.key_cache, a.value_cache, a.block_table, md, 0.125)
    plan = be._rows.get(a.block_table)
    again = be.varlen_attention(a.q, a.key_cache, a.value_cache, a.block_table, md, 0.125)
    assert be._rows.get(a.block_table) is plan  # the next layer of the same step
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    # Same metadata, another table (the same blocks moved): rebuilt, still right.
    moved_k, moved_v = a.key_cache.flip(0).contiguous(), a.value_cache.flip(0).contiguous()
    moved_table = torch.where(a.block_table >= 0, a.key_cache.shape[0] - 1 - a.block_table,
                              a.block_table)
    moved = be.varlen_attention(a.q, moved_k, moved_v, moved_table, md, 0.125)
    assert be._rows.get(moved_table) not in (None, plan)
    torch.testing.assert_close(moved, first, atol=FP32_TOL, rtol=0)
    # Back to the first table (a hybrid model's next layer in another group): its plan.
    be.varlen_attention(a.q, a.key_cache, a.value_cache, a.block_table, md, 0.125)
    assert be._rows.get(a.block_table) is plan


def test_head_sizes_off_the_vector_width_take_the_torch_path() -> None:
    b = make_paged_batch([6, 1], [6, 30], 6, 2, 72, 16, seed=4)
    assert not cpu_native.supports(b.q, b.key_cache, b.value_cache)
    check_against_oracle(get_backend("cpu"), b, FP32_TOL, decode=False)
    check_against_oracle(get_backend("cpu"), make_paged_batch([1, 1], [6, 30], 6, 2, 72, 16),
                         FP32_TOL, decode=True)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                      torch.float8_e4m3fn, torch.float8_e5m2])
def test_native_store_writes_what_the_torch_store_writes(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    kc = torch.zeros(6, 4, 2, 16, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    # k/v as the model hands them over: views into a fused qkv row (token stride 96).
    qkv = torch.randn(7, 96, generator=g) * 300  # past fp8's range: saturation
    k, v = qkv[:, 32:64].view(7, 2, 16), qkv[:, 64:].view(7, 2, 16)
    slots = torch.tensor([3, -1, 0, 23, -1, 9, 12])
    assert cpu_native.store_kv(k, v, kc, vc, slots)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv_torch(k, v, ref_k, ref_v, slots)
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    assert kc.view(torch.uint8).view(-1, 2 * 16 * kc.element_size()).count_nonzero(1).gt(0).sum() == 5


def test_native_store_rejects_a_slot_outside_the_pool() -> None:
    kc = torch.zeros(2, 4, 1, 16)
    vc = torch.zeros_like(kc)
    k = torch.ones(2, 1, 16)
    with pytest.raises(ValueError, match="slot outside"):
        cpu_native.store_kv(k, k, kc, vc, torch.tensor([1, 8]))
    assert kc.abs().sum() == 0  # checked before anything is written
    with pytest.raises(ValueError, match="slot outside"):
        get_backend("cpu").store_kv(k, k, kc, vc, torch.tensor([-2, 0]))


def test_store_then_rows_in_the_engine_order() -> None:
    """Store a chunked prefill's new tokens through the backend, then attend: what
    the attention layer does each step."""
    q_lens, k_lens = [8, 20], [24, 20]
    b = make_paged_batch(q_lens, k_lens, 9, 3, 64, 16, seed=6)
    be = get_backend("cpu")
    new = torch.cat([torch.arange(16, 24), torch.arange(24, 44)])  # rows of k/v being added
    slots = slots_for(b.block_table, k_lens, 16)[new]
    kc, vc = b.key_cache.clone(), b.value_cache.clone()
    kc.view(-1, 3, 64)[slots] = 0
    vc.view(-1, 3, 64)[slots] = 0
    be.store_kv(b.k[new], b.v[new], kc, vc, slots)
    assert torch.equal(kc, b.key_cache) and torch.equal(vc, b.value_cache)


def test_bf16_prefill_rows() -> None:
    b = make_paged_batch([12, 40, 1], [12, 40, 80], 8, 2, 64, 16, dtype=torch.bfloat16, seed=7)
    check_against_oracle(get_backend("cpu"), b, 2e-2, decode=False)


def test_decode_writes_into_a_given_output() -> None:
    b = make_paged_batch([1, 1, 1], [5, 40, 17], 9, 3, 64, 16, seed=8)
    lens = torch.tensor(b.key_lens)
    out = torch.full_like(b.q, float("nan"))
    got = cpu_native.paged_decode(b.q, b.key_cache, b.value_cache, b.block_table, lens, 40,
                                  0.125, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = cpu_native.paged_decode(b.q, b.key_cache, b.value_cache, b.block_table, lens, 40, 0.125)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_native.paged_decode(b.q, b.key_cache, b.value_cache, b.block_table, lens, 40, 0.125,
                                out=out[:2])
