"""Prefix caching for hybrid recurrent models (``mamba_cache_mode="align"``): state
snapshots at block boundaries (``scheduler.state_cache``, ``worker.mamba_state``).

A conversation continued from where it stopped and a prompt sent again resume from
the snapshot at their last cached block (exactly that many tokens reported cached)
and give the tokens an engine without the cache gives (Qwen3-Next's DeltaNet layers:
a convolution's inputs and a matrix a head, the parts every recurrent layer's slot
has; LFM2's convolution-only slots in ``test_lfm2``); so do prompts cut into prefill chunks, sequences
preempted by recompute (which resume from their own snapshots) and a directory too
small for every snapshot (the workers hold exactly what it holds). A reset frees
them all. The directory's rules are checked on their own."""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.scheduler.config import CacheConfig
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.state_cache import StateSnapshots
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next"])
def rounds(request, tmp_path_factory, default_model_dir):
    """A file, prompts of 3 to 48 tokens, their continuations (prompt + answer + three
    more tokens), and an uncached engine's answers to both."""
    path = write_random_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                   default_model_dir)
    prompts = prompts_of_mixed_lengths(6)
    ref = LLM(model=path, num_gpu_blocks=256, block_size=4)
    try:
        first = _tokens(ref.generate(prompts, GREEDY))
        turn2 = [p + o + [7, 8, 9] for p, o in zip(prompts, first, strict=True)]
        second = _tokens(ref.generate(turn2, GREEDY))
    finally:
        ref.shutdown()
    return path, prompts, first, turn2, second


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _held_alike(llm: LLM) -> None:
    """The workers hold exactly the snapshots the scheduler's directory does."""
    states = llm.engine.executor.worker.runner.states
    assert set(states.snapshot_of) == set(llm.engine.scheduler.snapshots.held)
    assert len(states.snapshot_of) + len(states.snap_free) == states.snap_conv[0].shape[0]


def test_continued_and_repeated_prompts_resume_from_their_snapshots(rounds) -> None:
    path, prompts, first, turn2, second = rounds
    llm = LLM(model=path, num_gpu_blocks=256, block_size=4, mamba_cache_mode="align")
    try:
        assert llm.engine.scheduler.kv.pool.enable_caching
        outs = llm.generate(prompts, GREEDY)
        assert _tokens(outs) == first and {o.num_cached_tokens for o in outs} == {0}
        again = llm.generate(prompts, GREEDY)  # (the prompt's last boundary before its end)
        assert _tokens(again) == first
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts]
        cont = llm.generate(turn2, GREEDY)  # (the first round's last boundary)
        assert _tokens(cont) == second
        assert [o.num_cached_tokens for o in cont] == [
            (len(p) + len(o) - 1) // 4 * 4 for p, o in zip(prompts, first, strict=True)]
        _held_alike(llm)
        assert llm.reset_prefix_cache() > 0
        llm.generate(prompts[:1], GREEDY)  # (the next plan frees them on the workers)
        assert len(llm.engine.scheduler.snapshots.held) <= 2
        _held_alike(llm)
    finally:
        llm.shutdown()


def test_chunks_preemption_and_a_full_directory_keep_the_answers(rounds) -> None:
    path, prompts, first, turn2, second = rounds
    llm = LLM(model=path, num_gpu_blocks=24, block_size=4, mamba_cache_mode="align",
              preemption_mode="recompute", max_num_batched_tokens=8, max_num_seqs=3)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == first
        assert _tokens(llm.generate(turn2, GREEDY)) == second
        assert llm.engine.scheduler.num_preemptions["recompute"] > 0
        assert len(llm.engine.scheduler.snapshots.held) == 6  # (2 x max_num_seqs)
        _held_alike(llm)
    finally:
        llm.shutdown()


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _row(req: Request, start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(req.request_id, req.all_token_ids[start:start + n], start, [],
                            [req.request_id])


def test_the_directory_resumes_at_held_blocks_keeps_two_a_sequence_and_evicts_lru() -> None:
    snaps = StateSnapshots(capacity=3, block_size=4)
    a = _request("a", list(range(10, 24)))  # 14 tokens: the prompt's boundary is 12
    assert snaps.align(a, 0, 14) == 12 and snaps.align(a, 12, 2) == 2
    row = _row(a, 0, 12)
    snaps.mark(a, row)
    assert row.save_state == a.block_hashes[2] == a.prompt_state and row.restore_state is None
    a.all_token_ids += [1, 2]  # (decoded to 16, then 20: its latest moves on)
    snaps.mark(a, _row(a, 12, 4))
    a.all_token_ids += [3, 4, 5, 6]
    snaps.mark(a, _row(a, 19, 1))
    assert list(snaps.held) == [a.block_hashes[2], a.block_hashes[4]]
    assert snaps.take_drops() == [a.block_hashes[3]]
    b = _request("b", [*a.all_token_ids[:18], 9, 9])  # shares 4 blocks, 3 have a state
    hits, num_hit = snaps.trim(b, ["h0", "h1", "h2", "h3"], 16)
    assert (hits, num_hit) == (["h0", "h1", "h2"], 12)
    assert b.state_junction == 16 and snaps.align(b, 12, 8) == 4  # (cut at the junction)
    row = _row(b, 12, 8)
    snaps.mark(b, row)
    assert row.restore_state == a.block_hashes[2]
    assert snaps.trim(_request("c", [5] * 9), ["x", "y"], 8) == ([], 0)
    for rid in "def":
        other = _request(rid, [ord(rid)] * 5)
        snaps.mark(other, _row(other, 0, 4))
    assert len(snaps.held) == 3 and a.block_hashes[2] not in snaps.held  # (oldest first)
    with pytest.raises(ValueError, match="capacity"):
        StateSnapshots(0, 4)
    with pytest.raises(ValueError, match="state_snapshots need prefix caching"):
        CacheConfig(num_gpu_blocks=8, enable_prefix_caching=False, state_snapshots=2)
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        EngineConfig(model="x", mamba_cache_mode="all")


def test_a_shared_system_prompt_keeps_a_snapshot_where_the_prompts_part(rounds) -> None:
    """Three requests after one 22-token system prompt: the second finds its KV cached
    but no snapshot there (the first's lie past where the prompts part), computes it
    and keeps one at the junction (20 tokens, the cached blocks' end); the third
    resumes there."""
    path = rounds[0]
    system = [(13 * j) % 4000 + 100 for j in range(22)]
    prompts = [[*system, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(3)]
    ref = LLM(model=path, num_gpu_blocks=96, block_size=4)
    try:
        want = _tokens(ref.generate(prompts, GREEDY))
    finally:
        ref.shutdown()
    llm = LLM(model=path, num_gpu_blocks=96, block_size=4, mamba_cache_mode="align")
    try:
        got, cached = [], []
        for p in prompts:
            (out,) = llm.generate([p], GREEDY)
            got.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
        assert got == want and cached == [0, 0, 20]
    finally:
        llm.shutdown()
