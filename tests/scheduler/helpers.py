"""Drive a Scheduler against the KV simulator and check its invariants."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from pagedserve.scheduler.admission import blocks_held
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import RELEASED
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.spec_decode import SpeculativeConfig
from tests.scheduler.kv_sim import KVSim


def make_scheduler(
    num_gpu_blocks: int = 64,
    block_size: int = 4,
    num_cpu_blocks: int = 0,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    preemption_mode: str = "swap",
    enable_prefix_caching: bool = True,
    speculative_config: SpeculativeConfig | None = None,
    copy_period: int | None = None,
    enable_kv_offload: bool = False,
    long_prefill_token_threshold: int = 0,
    max_concurrent_batches: int = 1,
    sliding_window: int | None = None,
    long_rope_from: int = 0,
    kv_group_windows: tuple[int | None, ...] = (),
) -> tuple[Scheduler, KVSim]:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=preemption_mode,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_concurrent_batches=max_concurrent_batches,
        ),
        CacheConfig(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            model_id="test-model",
            enable_kv_offload=enable_kv_offload,
            sliding_window=sliding_window,
            long_rope_from=long_rope_from,
            kv_group_windows=kv_group_windows,
        ),
        speculative_config,
    )
    return sched, KVSim(num_gpu_blocks, num_cpu_blocks, block_size, copy_period,
                        sliding_window, kv_group_windows)


SHARED_PREFIX = [5, 6, 7, 8, 9, 10, 11, 12]

# What the state machines draw for ``machine_scheduler`` and ``add_numbered``.
SCHEDULER_DRAWS = {
    "gpu_blocks": st.integers(8, 24),
    "cpu_blocks": st.integers(0, 12),
    "mode": st.sampled_from(["swap", "recompute"]),
    "budget": st.integers(2, 24),
    "spec": st.sampled_from([None, None, 1, 3]),
    "copy_period": st.sampled_from([None, 2, 5]),
    "offload": st.booleans(),
    # A window for every layer, or a hybrid model's groups (full and sliding tables).
    "window": st.sampled_from([None, None, 3, 6, 10, (None, 6), (None, 3, 3), (10, 4)]),
}
REQUEST_DRAWS = {
    "prompt_len": st.integers(1, 20),
    "shared": st.booleans(),
    "max_tokens": st.integers(1, 10),
    "n": st.integers(1, 3),
    "salt": st.sampled_from([None, None, "t1"]),
}


def machine_scheduler(gpu_blocks: int, cpu_blocks: int, mode: str, budget: int,
                      spec: int | None, copy_period: int | None, offload: bool,
                      depth: int = 1, window: int | tuple[int | None, ...] | None = None,
                      ) -> tuple[Scheduler, KVSim]:
    """The state machines' scheduler: blocks of 4 tokens, six seats, ``depth`` plans in
    flight at most, n-gram drafts of ``spec`` tokens, offloading when there is a CPU tier,
    blocks released behind a sliding ``window``, or one table per KV cache group when
    ``window`` is a hybrid model's group windows."""
    groups = window if isinstance(window, tuple) else ()
    return make_scheduler(
        num_gpu_blocks=gpu_blocks,
        block_size=4,
        num_cpu_blocks=cpu_blocks,
        preemption_mode=mode,
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        speculative_config=None if spec is None else SpeculativeConfig(
            num_speculative_tokens=spec, prompt_lookup_max=3),
        copy_period=copy_period,
        enable_kv_offload=offload and cpu_blocks > 0,
        max_concurrent_batches=depth,
        sliding_window=None if groups else window,
        kv_group_windows=groups,
    )


def add_numbered(sched: Scheduler, number: int, prompt_len: int, shared: bool,
                 max_tokens: int, n: int, salt: str | None = None) -> None:
    """Request ``q<number>``: tokens of its own, after the shared prefix or not; one
    that could never fit the pool is refused (and nothing else may be)."""
    tail = [100 + ((number + 1) * 13 + j) % 80 for j in range(prompt_len)]
    prompt = (SHARED_PREFIX + tail) if shared else tail
    try:
        sched.add_request(req(f"q{number}", prompt, max_tokens, n=n, salt=salt, sched=sched))
    except ValueError as e:
        assert "KV blocks" in str(e)


def req(
    rid: str,
    prompt: list[int],
    max_tokens: int = 8,
    n: int = 1,
    salt: str | None = None,
    sched: Scheduler | None = None,
) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0)
    if sched is not None:
        return sched.make_request(rid, prompt, params, cache_salt=salt)
    return Request(rid, prompt, params, extra_keys=("test-model",))


def step(sched: Scheduler, sim: KVSim) -> dict[str, list[int]]:
    plan = sched.schedule()
    out = sim.execute(plan)
    produced: dict[str, list[int]] = {}
    for u in sched.update_from_output(plan, out):
        produced.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
    check_invariants(sched, sim)
    return produced


def run_to_completion(
    sched: Scheduler, sim: KVSim, max_steps: int = 10_000
) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        for rid, toks in step(sched, sim).items():
            outputs.setdefault(rid, []).extend(toks)
    raise AssertionError("scheduler did not finish")


def check_invariants(sched: Scheduler, sim: KVSim | None = None) -> None:
    """Refcounts equal table membership; free and referenced are disjoint; every
    hash names one block whose simulated content is the hashed tokens."""
    pool = sched.kv.pool
    holders: Counter[int] = Counter()
    groups = sched.kv.group_managers
    for g in groups:
        window = g.sliding_window
        for rid, blocks in g.req_blocks.items():
            live = [b for b in blocks if b is not RELEASED]
            for b in live:
                holders[b.block_id] += 1
            if window is not None:  # what a step may hold, and nothing released is written
                assert len(live) <= blocks_held(1 << 30, sched.config, sched.block_size, window)
                assert all(b is RELEASED for b in blocks[:len(blocks) - len(live)]), rid
    free_ids = {b.block_id for b in pool.free_queue}
    assert len(free_ids) == pool.num_free_blocks
    for b in pool.blocks:
        assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
        assert (b.ref_cnt == 0) == (b.block_id in free_ids), b
    for h, b in pool.cached.items():
        assert b.block_hash == h
    for g in groups:
        for rid, blocks in g.req_blocks.items():
            assert g.req_block_ids[rid] == [b.block_id for b in blocks]
            r = sched.requests[rid]
            assert len(blocks) * sched.block_size >= r.num_computed_tokens
            hashes = r.update_block_hashes(sched.block_size)
            for i, b in enumerate(blocks):
                if b.block_hash is not None:
                    assert b.block_hash == g.salted(hashes[i]), f"{rid} block {i} names others"
    if sim is not None:
        B = sched.block_size
        for g in groups:
            for rid, blocks in g.req_blocks.items():
                r = sched.requests[rid]
                for p in range(r.num_computed_tokens):
                    if blocks[p // B] is not RELEASED:
                        assert sim.gpu[blocks[p // B].block_id][p % B] == r.all_token_ids[p]
        for b in pool.cached.values():
            assert None not in sim.gpu[b.block_id]
        for r in sched.requests.values():  # offloaded blocks hold what their hash names
            for i, h in enumerate(r.update_block_hashes(B)):
                for g in groups:
                    cpu_id = sched.kv.cpu_pool.lookup(g.salted(h))
                    if cpu_id is not None:
                        assert sim.cpu[cpu_id] == r.all_token_ids[i * B:(i + 1) * B], (r, i)
    cpu = sched.kv.cpu_pool
    used_cpu = sum(c >= 0 for g in groups for s in g.swapped.values() for c in s.cpu_block_ids)
    assert used_cpu == cpu.num_owned_blocks
    assert cpu.num_owned_blocks + cpu.num_cached_blocks + cpu.num_free_blocks == cpu.num_blocks


def assert_baseline(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not any(g.req_blocks or g.swapped for g in sched.kv.group_managers)
    cpu = sched.kv.cpu_pool
    assert cpu.num_owned_blocks == 0
    assert cpu.num_free_blocks + cpu.num_cached_blocks == cpu.num_blocks
    assert not sched.requests and not sched.groups
