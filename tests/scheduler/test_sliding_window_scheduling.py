"""Blocks released behind a sliding window (a model whose every layer slides).

The KV simulator reads only the last ``window`` positions, as the attention does, and
fails on a released (-1) entry there; every run is compared with the same "model"
served without releasing anything, so a block given back too early, or a table that
loses its place, changes the tokens or trips the simulator.
"""

from __future__ import annotations

import pytest

from pagedserve.scheduler.admission import blocks_held
from pagedserve.scheduler.kv_cache_manager import RELEASED
from pagedserve.scheduler.memory import memory_stats
from pagedserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.helpers import (
    assert_baseline,
    check_invariants,
    make_scheduler,
    req,
    run_to_completion,
    step,
)
from tests.scheduler.kv_sim import KVSim

WINDOW, B = 6, 4


def _prompts() -> dict[str, list[int]]:
    return {f"r{i}": [100 + (7 * i + 3 * j) % 90 for j in range(5 + 11 * i)] for i in range(4)}


def _run(release: bool, **kw) -> tuple[dict[str, list[int]], object]:
    """The prompts to completion; ``release`` gives blocks back behind the window, else
    the same windowed "model" keeps every block."""
    sched, _ = make_scheduler(sliding_window=WINDOW if release else None, block_size=B, **kw)
    sim = KVSim(kw.get("num_gpu_blocks", 64), kw.get("num_cpu_blocks", 0), B, window=WINDOW)
    for rid, prompt in _prompts().items():
        sched.add_request(req(rid, prompt, max_tokens=30, sched=sched))
    out = run_to_completion(sched, sim)
    assert_baseline(sched)
    return out, sched


def test_release_changes_no_token_and_bounds_the_blocks_held() -> None:
    kept, _ = _run(False, max_num_batched_tokens=8)
    sched, sim = make_scheduler(sliding_window=WINDOW, block_size=B, max_num_batched_tokens=8)
    sim = KVSim(64, 0, B, window=WINDOW)
    for rid, prompt in _prompts().items():
        sched.add_request(req(rid, prompt, max_tokens=30, sched=sched))
    out: dict[str, list[int]] = {}
    peak = released = 0
    bound = blocks_held(1 << 30, sched.config, B, WINDOW)
    while sched.has_unfinished_requests():
        for rid, toks in step(sched, sim).items():
            out.setdefault(rid, []).extend(toks)
        for blocks in sched.kv.req_blocks.values():
            live = sum(b is not RELEASED for b in blocks)
            peak, released = max(peak, live), max(released, len(blocks) - live)
    assert out == kept
    # Without releasing, the longest request (38-token prompt, 30 out) held 17 blocks.
    assert peak <= bound == 5 and released >= 12


@pytest.mark.parametrize(("mode", "cpu_blocks"), [("swap", 16), ("recompute", 0)])
def test_preemption_under_a_window_gives_the_same_tokens(mode: str, cpu_blocks: int) -> None:
    """A pool of 9 blocks for four requests: they preempt each other (swapping out
    tables with released entries, or recomputing) and still match a roomy run."""
    roomy, _ = _run(True, max_num_batched_tokens=8)
    tight, sched = _run(True, num_gpu_blocks=9, num_cpu_blocks=cpu_blocks,
                        preemption_mode=mode, max_num_batched_tokens=8)
    assert tight == roomy
    assert sum(sched.num_preemptions.values()) > 0


def test_forks_and_prefix_hits_under_a_window() -> None:
    """n=3 siblings share released entries; the same prompt again hits the cache, its
    hits behind the window come back released rather than revived."""
    sched, sim = make_scheduler(sliding_window=WINDOW, block_size=B)
    sim = KVSim(64, 0, B, window=WINDOW)
    prompt = [100 + j % 50 for j in range(29)]
    params = SamplingParams(n=3, max_tokens=12, temperature=0.0)
    sched.add_request(sched.make_request("a", prompt, params))
    first = run_to_completion(sched, sim)
    sched.add_request(sched.make_request("b", prompt, params))
    plan = sched.schedule()
    (sr,) = plan.scheduled
    assert sr.num_computed_tokens == 28  # 7 full blocks hit
    assert sr.block_table[:5] == [-1] * 5  # before the window of position 28
    second: dict[str, list[int]] = {}
    for u in sched.update_from_output(plan, sim.execute(plan)):
        second.setdefault(u.request_id, []).extend(t.token_id for t in u.new_tokens)
    check_invariants(sched, sim)
    for rid, toks in run_to_completion(sched, sim).items():
        second.setdefault(rid, []).extend(toks)
    assert len(first) == 3 and {k.replace("a", "b", 1): v for k, v in first.items()} == second
    assert_baseline(sched)


def test_a_request_longer_than_the_pool_fits_under_a_window() -> None:
    """Admission counts the blocks a windowed request can hold at once, not its length;
    the stats count only the tokens still held."""
    sched, _ = make_scheduler(num_gpu_blocks=8, block_size=B, max_num_batched_tokens=4,
                              sliding_window=WINDOW)
    sim = KVSim(8, 0, B, window=WINDOW)
    sched.add_request(req("long", [100 + j % 60 for j in range(60)], max_tokens=20,
                          sched=sched))
    out: list[int] = []
    for _ in range(20):
        out += step(sched, sim).get("long", [])
    stats = memory_stats(sched)
    assert 0 < stats.kv_tokens <= stats.allocated_slots <= 8 * B
    out += run_to_completion(sched, sim).get("long", [])
    assert len(out) == 20
    plain, _ = make_scheduler(num_gpu_blocks=8, block_size=B, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="KV blocks"):
        plain.add_request(req("long", [100] * 60, max_tokens=20, sched=plain))


def test_a_hit_needs_only_the_blocks_its_window_sees() -> None:
    """The prompt's first blocks evicted (as their release put them at the free queue's
    head): the repeat still hits 7 blocks, since its first query sees only blocks 5 and
    6; evicting block 5 moves the hit back to 5 blocks (whose window starts at block 3)."""
    prompt = [100 + j % 50 for j in range(29)]
    for evicted, want in (((0, 1, 2), 28), ((5,), 20)):
        sched, sim = make_scheduler(sliding_window=WINDOW, block_size=B)
        sched.add_request(req("a", prompt, max_tokens=1, sched=sched))
        run_to_completion(sched, sim)
        hashes = req("h", prompt, sched=sched).update_block_hashes(B)
        for i in evicted:
            sched.kv.pool._evict(sched.kv.pool.get_cached_block(hashes[i]))
        hits, num_hit = sched.kv.get_computed_blocks(req("b", prompt, sched=sched))
        assert num_hit == want
        assert all(b is RELEASED for b in hits[:(want - WINDOW + 1) // B])
        sched.add_request(req("b", prompt, max_tokens=4, sched=sched))
        out = run_to_completion(sched, sim)
        assert len(out["b"]) == 4
        assert_baseline(sched)
