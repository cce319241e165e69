"""Images in the scheduler: chunks never stop inside an image, an image's blocks hash
with its content key, an image no step could hold is refused, and each row carries
the image rows and whole spans its chunk computes."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.block_hash import hash_prompt_blocks
from pagedserve.scheduler.multimodal import (
    ImageInput,
    block_image_keys,
    chunk_images,
    fit_chunk,
    mrope_grids,
    rope_delta,
)
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.helpers import make_scheduler

IMG = 99


def prompt_with(images: list[tuple[int, int]], n: int) -> list[int]:
    ids = [3 + i % 50 for i in range(n)]
    for a, b in images:
        ids[a:b] = [IMG] * (b - a)
    return ids


def image(a: int, b: int, key: str = "k") -> ImageInput:
    return ImageInput(a, b, key, pixels=f"pixels-{key}")


def test_fit_chunk_cuts_back_to_an_images_start() -> None:
    imgs = [image(4, 12), image(20, 28)]
    assert fit_chunk(imgs, 0, 8) == 4            # would stop inside the first image
    assert fit_chunk(imgs, 0, 12) == 12          # ends exactly at its end
    assert fit_chunk(imgs, 0, 4) == 4            # ends at its start
    assert fit_chunk(imgs, 4, 6) == 0            # starts there: waits for room
    assert fit_chunk(imgs, 6, 4) == 0            # a hit left it inside: waits too
    assert fit_chunk(imgs, 6, 6) == 6            # finishes it
    assert fit_chunk(imgs, 12, 10) == 8          # stops before the second one
    assert fit_chunk(imgs, 28, 5) == 5


def test_chunk_images_gives_rows_and_whole_spans() -> None:
    imgs = [image(4, 12, "a"), image(20, 28, "b")]
    chunks, spans = chunk_images(imgs, 8, 20)  # the tail of a (a hit stopped at 8), all of b
    assert [(c.offset, c.first, c.count, c.key) for c in chunks] == [(0, 4, 4, "a"),
                                                                      (12, 0, 8, "b")]
    assert spans == [(4, 12), (20, 28)]
    assert chunk_images(imgs, 12, 8) == ([], [])


def test_block_keys_mark_only_blocks_an_image_overlaps() -> None:
    imgs = [image(5, 9, "a")]
    assert [block_image_keys(imgs, 4, b) for b in range(4)] == [
        (), ("image:a",), ("image:a",), ()]


def test_blocks_hash_with_their_images_and_chain_past_them() -> None:
    ids = prompt_with([(4, 8)], 16)
    plain = hash_prompt_blocks(ids, 4)
    a = hash_prompt_blocks(ids, 4, images=[image(4, 8, "a")])
    b = hash_prompt_blocks(ids, 4, images=[image(4, 8, "b")])
    assert a[0] == b[0] == plain[0]  # the text before the image is shared
    assert a[1] != b[1] and a[1] != plain[1]
    assert a[2] != b[2] and a[3] != b[3]  # later blocks differ through the chain


@pytest.mark.parametrize("bad, match", [
    ([image(4, 8), image(6, 10)], "overlaps"),
    ([image(12, 20)], "past the prompt"),
])
def test_bad_spans_are_refused(bad: list[ImageInput], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Request("r", prompt_with([], 16), SamplingParams(), images=bad)


@pytest.mark.parametrize("kw, match", [
    (dict(grid=(2, 2), times=(0, 1)), r"x 2 slices does not hold the span \[0, 12\)"),
    (dict(grid=(2, 3), times=(0, 3, 1)), "non-decreasing"),
    (dict(grid=(2, 3), times=()), "non-decreasing"),
    (dict(grid=(2, 3), times=(-1, 0)), "non-decreasing"),
])
def test_bad_video_grids_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ImageInput(0, 12, "v", None, causal=True, **kw)


def test_a_videos_rope_delta_counts_its_last_time() -> None:
    """Two slices of 2 x 3 at times 0 and 7 take 12 tokens and advance the positions 8:
    past the last time (a picture of 2 x 3 advances them 3)."""
    video = ImageInput(2, 14, "v", None, (2, 3), True, (0, 7))
    picture = ImageInput(20, 26, "p", None, (2, 3), True)
    assert video.positions == 8 and picture.positions == 3
    assert rope_delta([video, picture]) == (8 - 12) + (3 - 6)
    assert mrope_grids([video, picture], 21) == ((2, 2, 3, (0, 7)), (20, 2, 3, (0,)))


def test_an_image_longer_than_a_step_is_refused_at_admission() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    req = sched.make_request("r", prompt_with([(2, 14)], 20), SamplingParams(max_tokens=2),
                             images=(image(2, 14),))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(req)
    sched, _ = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    req = sched.make_request("r", prompt_with([(2, 14)], 20), SamplingParams(max_tokens=2),
                             images=(image(2, 14),))
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        sched.add_request(req)


def run_to_end(sched, sim, max_steps: int = 200) -> list[list[tuple[str, int, int]]]:
    """Every step's (request, first token, count) until nothing is left."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        steps.append([(r.request_id, r.num_computed_tokens, r.num_tokens)
                      for r in plan.scheduled])
        sched.update_from_output(plan, sim.execute(plan))
    return steps


def test_chunks_never_stop_inside_an_image() -> None:
    sched, sim = make_scheduler(max_num_batched_tokens=10, num_gpu_blocks=64)
    spans = [(3, 11), (14, 22)]
    req = sched.make_request("r", prompt_with(spans, 30), SamplingParams(max_tokens=3),
                             images=tuple(image(a, b, str(a)) for a, b in spans))
    sched.add_request(req)
    plan = sched.schedule()
    assert [(r.num_computed_tokens, r.num_tokens) for r in plan.scheduled] == [(0, 3)]
    assert plan.scheduled[0].images is None
    sched.update_from_output(plan, sim.execute(plan))
    plan = sched.schedule()
    row = plan.scheduled[0]
    assert (row.num_computed_tokens, row.num_tokens) == (3, 10)  # the first image, whole
    assert [(c.offset, c.first, c.count) for c in row.images] == [(0, 0, 8)]
    assert row.image_spans == [(3, 11)]
    sched.update_from_output(plan, sim.execute(plan))
    for step in run_to_end(sched, sim):
        for _, start, n in step:
            assert not any(a < start + n < b for a, b in spans)
    assert sched.kv.pool.num_free_blocks == 64


def test_a_second_prompt_with_the_same_image_hits_and_another_image_does_not() -> None:
    sched, sim = make_scheduler(max_num_batched_tokens=64)
    ids = prompt_with([(4, 12)], 20)
    first = sched.make_request("a", ids, SamplingParams(max_tokens=2), images=(image(4, 12, "x"),))
    sched.add_request(first)
    run_to_end(sched, sim)
    same = sched.make_request("b", ids, SamplingParams(max_tokens=2), images=(image(4, 12, "x"),))
    other = sched.make_request("c", ids, SamplingParams(max_tokens=2),
                               images=(image(4, 12, "y"),))
    sched.add_request(same)
    sched.add_request(other)
    plan = sched.schedule()
    starts = {r.request_id: r.num_computed_tokens for r in plan.scheduled}
    assert starts == {"b": 16, "c": 4}  # c shares only the block before its image
    assert plan.scheduled[0].images is None  # b's image is all in the cache
    row_c = plan.scheduled[1]
    assert [(c.offset, c.first, c.count, c.key) for c in row_c.images] == [(0, 0, 8, "y")]
    run_to_end(sched, sim)


def test_a_pipelined_budget_share_still_fits_a_whole_image() -> None:
    sched, sim = make_scheduler(max_num_batched_tokens=32, max_concurrent_batches=4)
    req = sched.make_request("r", prompt_with([(2, 18)], 20), SamplingParams(max_tokens=2),
                             images=(image(2, 18),))
    sched.add_request(req)
    steps = run_to_end(sched, sim)
    assert not sched.has_unfinished_requests()
    assert any(start <= 2 and start + n >= 18 for step in steps for _, start, n in step)


def test_a_causal_image_is_admitted_past_a_step_and_cut_into_chunks() -> None:
    """LLaVA's and Qwen2-VL's images attend causally: one longer than a step's budget is
    admitted and computed in chunks, each carrying its rows of the picture (the worker
    slices them from one encoder output)."""
    assert fit_chunk([ImageInput(4, 12, "k", None, causal=True)], 0, 8) == 8
    sched, sim = make_scheduler(max_num_batched_tokens=5, num_gpu_blocks=64)
    img = ImageInput(2, 14, "k", "pixels", causal=True)
    req = sched.make_request("r", prompt_with([(2, 14)], 20), SamplingParams(max_tokens=2),
                             images=(img,))
    sched.add_request(req)
    rows = []
    for _ in range(10):
        plan = sched.schedule()
        for r in plan.scheduled:
            if r.images:
                rows += [(r.num_computed_tokens + c.offset, c.first, c.count)
                         for c in r.images]
        sched.update_from_output(plan, sim.execute(plan))
    assert rows == [(2, 0, 3), (5, 3, 5), (10, 8, 4)]  # the picture's 12 rows, in order
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == 64
