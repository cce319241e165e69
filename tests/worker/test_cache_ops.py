"""Swap-out, swap-in and copy-on-write through the runner's plan keep KV content intact."""

from __future__ import annotations

import pytest
import torch

from pagedserve.scheduler.outputs import ModelRunnerOutput, ScheduledRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import KVCache
from tests.worker.helpers import all_logits, load_hf, make_worker, plan, save_tiny_model

B = 4
GREEDY = SamplingParams(temperature=0.0)


def _req(rid, tokens, computed, table, sample=True):
    ids = [rid] if sample else []
    return ScheduledRequest(rid, tokens, computed, table, ids, {i: GREEDY for i in ids})


def _blocks(kv: KVCache, ids: list[int], cpu: bool = False) -> list[torch.Tensor]:
    ks = kv.cpu_key_caches if cpu else kv.key_caches
    vs = kv.cpu_value_caches if cpu else kv.value_caches
    idx = torch.tensor(ids)
    return [c.index_select(0, idx).clone() for c in ks + vs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m"), "llama", seed=6)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


def _hf_last(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def test_swap_out_in_and_cow_preserve_context(model_dir, hf):
    w = make_worker(model_dir, num_blocks=16, block_size=B, num_cpu_blocks=6)
    kv = w.kv_cache
    prompt = [5, 9, 17, 33, 4, 12, 7, 40, 41, 42]  # 10 tokens: 3 blocks, last one partial
    a_table = [11, 3, 8]
    out = w.execute_model(plan(0, [_req("a", prompt, 0, a_table)]))
    assert isinstance(out, ModelRunnerOutput) and "a" in out.sampled
    before = _blocks(kv, a_table)

    # A plan with only swaps (nothing scheduled) works and returns an empty output.
    out = w.execute_model(plan(1, [], blocks_to_swap_out=[(11, 0), (3, 4), (8, 2)]))
    assert out is not None and out.step_id == 1 and out.sampled == {}
    for x, y in zip(_blocks(kv, [0, 4, 2], cpu=True), before):
        assert torch.equal(x, y)

    # Another request overwrites a's old device blocks.
    other = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]
    w.execute_model(plan(2, [_req("b", other, 0, [8, 11, 3])]))
    assert not torch.equal(_blocks(kv, [11])[0], before[0][:1])

    # Swap a back in to new blocks, copy its partial last block for a fork (CoW),
    # and decode a and the fork in the same step, with different next tokens.
    new_table = [5, 14, 1]
    fork_table = [5, 14, 9]
    p = plan(3, [_req("a", [50], 10, new_table), _req("f", [51], 10, fork_table)],
             blocks_to_swap_in=[(5, 0), (14, 4), (1, 2)], blocks_to_copy=[(1, 9)])
    logits = all_logits(w, p)
    torch.testing.assert_close(logits[0], _hf_last(hf, [*prompt, 50]), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits[1], _hf_last(hf, [*prompt, 51]), atol=2e-5, rtol=1e-4)
    # The fork's write went to its own copy: a's block 1 still holds token 50 at slot 2.
    a_next = all_logits(w, plan(4, [_req("a", [52], 11, new_table)]))
    torch.testing.assert_close(a_next[0], _hf_last(hf, [*prompt, 50, 52]), atol=2e-5,
                               rtol=1e-4)


def test_swap_out_then_in_same_step_reuses_freed_block(model_dir):
    """Swap-out runs before swap-in, so a block freed by a swap-out can be refilled at once."""
    w = make_worker(model_dir, num_blocks=8, block_size=B, num_cpu_blocks=4)
    kv = w.kv_cache
    w.execute_model(plan(0, [_req("a", [1, 2, 3, 4], 0, [2]), _req("b", [9, 8, 7, 6], 0, [5])]))
    a_blk, b_blk = _blocks(kv, [2]), _blocks(kv, [5])
    w.execute_model(plan(1, [], blocks_to_swap_out=[(5, 3)]))  # b out to cpu 3
    # One step: a goes out of device block 2 to cpu 1, b comes back into device block 2.
    w.execute_model(plan(2, [], blocks_to_swap_out=[(2, 1)], blocks_to_swap_in=[(2, 3)]))
    for x, y in zip(_blocks(kv, [1], cpu=True), a_blk):
        assert torch.equal(x, y)
    for x, y in zip(_blocks(kv, [2]), b_blk):
        assert torch.equal(x, y)


def test_copy_chain_reads_old_content(model_dir):
    w = make_worker(model_dir, num_blocks=8, block_size=B, num_cpu_blocks=0)
    kv = w.kv_cache
    w.execute_model(plan(0, [_req("a", [1, 2, 3, 4], 0, [1]), _req("b", [5, 6, 7, 8], 0, [2])]))
    one, two = _blocks(kv, [1]), _blocks(kv, [2])
    w.execute_model(plan(1, [], blocks_to_copy=[(1, 2), (2, 3)]))
    for x, z in zip(_blocks(kv, [2]), one):
        assert torch.equal(x, z)
    for y, z in zip(_blocks(kv, [3]), two):
        assert torch.equal(y, z)


def test_bad_block_ids_are_rejected(model_dir):
    w = make_worker(model_dir, num_blocks=4, block_size=B, num_cpu_blocks=2)
    with pytest.raises(IndexError):
        w.execute_model(plan(0, [], blocks_to_swap_out=[(0, 2)]))
    with pytest.raises(IndexError):
        w.execute_model(plan(0, [], blocks_to_copy=[(0, 4)]))
    with pytest.raises(ValueError, match="block table"):
        w.execute_model(plan(0, [_req("a", [1, 2, 3, 4, 5], 0, [0])]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_read_from_one_pool_land_bit_exact_in_another(dtype) -> None:
    """What disaggregated prefill ships: K/V of some blocks, into other block ids of a
    pool of another size; fp8 travels as its bytes."""
    from pagedserve.kernels.backend import get_backend

    backend = get_backend("torch", torch.device("cpu"))
    src = KVCache(3, 6, B, 2, 8, dtype, torch.device("cpu"), backend)
    dst = KVCache(3, 9, B, 2, 8, dtype, torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(0)
    for c in src.key_caches + src.value_caches:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    keys, values = src.read_blocks([4, 1])
    assert keys.shape == (3, 2, B, 2, 8) and keys.dtype == dtype
    dst.write_blocks([7, 0], keys, values)
    as_bytes = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
    for s, d in zip(src.key_caches + src.value_caches, dst.key_caches + dst.value_caches):
        assert torch.equal(as_bytes(d[7]), as_bytes(s[4]))
        assert torch.equal(as_bytes(d[0]), as_bytes(s[1]))
        assert not as_bytes(d[1:7]).any()  # nothing else written
    with pytest.raises(ValueError, match="shipped keys"):
        dst.write_blocks([0], keys, values)  # two blocks' worth for one id
    with pytest.raises(IndexError):
        dst.write_blocks([0, 9], keys, values)
    with pytest.raises(IndexError):
        src.read_blocks([6])
