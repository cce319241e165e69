"""A plan's host tensors (``ModelRunner.prepare_inputs``): ids, positions, -1 padded
block tables and slots, built through numpy's ``fromiter`` (``int_tensor``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunner, int_tensor


@pytest.mark.parametrize("values,dtype", [([], np.int32), ([5, -1, 0, 2**31 - 1], np.int32),
                                          ([2**40, -3, 7], np.int64)])
def test_int_tensor_equals_torch_tensor(values: list[int], dtype) -> None:
    want = torch.tensor(values, dtype=torch.int32 if dtype is np.int32 else torch.int64)
    got = int_tensor(values, dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)


def _row(rid: str, token_ids: list[int], start: int, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, token_ids, start, table, [rid], {rid: SamplingParams()})


def _runner(block_size: int, long_rope: bool = False, mrope: bool = False
            ) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, device=torch.device("cpu"),
                           long_rope=long_rope, mrope=mrope, states=None)


def test_long_rope_rows_carry_their_mark_in_the_positions() -> None:
    """Under LongRoPE the long rows' positions carry ``LONG_ROPE_MARK`` (the slots do
    not), which the rotary embedding reads back as the long factors."""
    from pagedserve.worker.layers.rotary import LONG_ROPE_MARK

    reqs = [_row("a", [1, 2, 3], 0, [2]), _row("b", [4], 5, [3, 6])]
    reqs[1].long_rope = True
    inputs = ModelRunner.prepare_inputs(_runner(4, long_rope=True), SchedulerOutput(1, reqs))
    assert inputs.positions.tolist() == [0, 1, 2, 5 + LONG_ROPE_MARK]
    assert inputs.md.slot_mapping.tolist() == [8, 9, 10, 25]


def test_mrope_rows_turn_on_their_grids_and_slots_stay_by_index() -> None:
    """Under M-RoPE a chunk over a 2 x 3 picture gets ``[3, T]`` positions from its
    grid, a decode row past it its index plus ``rope_delta`` (-3: six tokens, three
    positions), a text row its index; the slots follow the token index."""
    chunk = _row("a", [5, 9, 9, 9, 9, 9, 9, 6], 0, [2, 7])
    chunk.mrope_grids, chunk.rope_delta = ((1, 2, 3, (0,)),), -3
    decode = _row("b", [7], 9, [3, 6, 1])
    decode.rope_delta = -3
    text = _row("c", [8, 8], 2, [4])
    inputs = ModelRunner.prepare_inputs(_runner(4, mrope=True),
                                        SchedulerOutput(1, [chunk, decode, text]))
    assert inputs.positions.tolist() == [[0, 1, 1, 1, 1, 1, 1, 4, 6, 2, 3],
                                         [0, 1, 1, 1, 2, 2, 2, 4, 6, 2, 3],
                                         [0, 1, 2, 3, 1, 2, 3, 4, 6, 2, 3]]
    assert inputs.md.slot_mapping.tolist() == [8, 9, 10, 11, 28, 29, 30, 31, 5, 18, 19]
    decode_only = ModelRunner.prepare_inputs(_runner(4, mrope=True),
                                             SchedulerOutput(2, [decode]))
    assert decode_only.positions.tolist() == [6]  # 1-D: what decode graphs replay


def test_a_mixed_plan_becomes_the_expected_tensors() -> None:
    """Three rows of the seed-000 shapes at block size 4 (a prompt of 10 with no
    context, 3 new after 1 cached, a decode after 6): ids, positions, slots through
    non-contiguous blocks, and the table padded with -1 to the longest row."""
    reqs = [_row("a", list(range(100, 110)), 0, [2, 7, 9]), _row("b", [200, 201, 202], 1, [4]),
            _row("c", [300], 6, [0, 5])]
    inputs = ModelRunner.prepare_inputs(_runner(4), SchedulerOutput(1, reqs))
    assert inputs.input_ids.tolist() == [*range(100, 110), 200, 201, 202, 300]
    assert inputs.input_ids.dtype == torch.int64
    assert inputs.positions.tolist() == [*range(10), 1, 2, 3, 6]
    md = inputs.md
    assert md.block_table.dtype == torch.int32
    assert md.block_table.tolist() == [[2, 7, 9], [4, -1, -1], [0, 5, -1]]
    assert md.slot_mapping.tolist() == [8, 9, 10, 11, 28, 29, 30, 31, 36, 37,
                                        17, 18, 19, 22]
    assert md.seq_lens.tolist() == [10, 4, 7] and not md.is_decode
    decode = ModelRunner.prepare_inputs(_runner(4), SchedulerOutput(2, [
        _row("c", [301], 7, [0, 5]), _row("d", [400], 8, [3, 1, 6])]))
    assert decode.md.is_decode and decode.positions.tolist() == [7, 8]
    assert decode.md.block_table.tolist() == [[0, 5, -1], [3, 1, 6]]
    assert decode.md.slot_mapping.tolist() == [23, 24]
