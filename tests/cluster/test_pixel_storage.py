"""Pixels shipped in step plans own their storage: a picture cut from a batched
tensor, pickled for a Ray rank, carries its own bytes, not the whole batch's."""

from __future__ import annotations

import pickle

import torch

from pagedserve.cluster.pixel_storage import own_storage
from pagedserve.cluster.processor_options import pan_and_scan_inputs
from pagedserve.worker.anyres import AnyresPixels
from pagedserve.worker.video_pixels import VideoPixels

ONE = 3 * 8 * 8 * 4  # one [3, 8, 8] fp32 picture's bytes


def test_views_are_copied_and_whole_tensors_kept() -> None:
    batch = torch.randn(6, 3, 8, 8)
    pics = [own_storage(p) for p in batch]
    assert all(len(pickle.dumps(p)) < 2 * ONE for p in pics)
    assert all(torch.equal(p, b) for p, b in zip(pics, batch, strict=True))
    whole = torch.randn(3, 8, 8)
    assert own_storage(whole) is whole  # nothing to copy
    crops = own_storage(AnyresPixels(batch[:1], 8, 8))
    assert len(pickle.dumps(crops)) < 2 * ONE and crops.height == 8
    video = own_storage(VideoPixels(batch[2:4], (0, 1)))
    assert len(pickle.dumps(video)) < 3 * ONE and video.times == (0, 1)


def test_pan_and_scan_views_ship_alone() -> None:
    views = torch.randn(3, 3, 8, 8)  # the whole picture and two crops
    inputs = pan_and_scan_inputs([(0, 4), (4, 8), (8, 12)], [views], ["k"], 4)
    assert [i.key for i in inputs] == ["k:0", "k:1", "k:2"]
    assert all(len(pickle.dumps(i.pixels)) < 2 * ONE for i in inputs)
