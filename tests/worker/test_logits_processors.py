"""The persistent batch custom logits processors see (``ProcessorBatch``): whatever
rows each step samples, in whatever order, a processor that keeps per-row state the
way vLLM's own processors do finds each request at the row its state says."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.logits_processors import (
    BatchUpdate,
    LogitsProcessor,
    ProcessorBatch,
    apply_moves,
    load_processor_classes,
)
from pagedserve.worker.sampler import SampleRequest


class Recording(LogitsProcessor):
    """Keeps each row's request (``extra_args["who"]``) and output list as vLLM's
    processors keep state, and checks them against the logits it is given: column 0
    of each row holds its request's number, column 1 its output count."""

    def __init__(self, config: Any = None, device: Any = None, pin: bool = False) -> None:
        self.rows: dict[int, tuple[int, list[int]]] = {}
        self.size = 0
        self.checked = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.size = batch_update.batch_size
        for row, params, _, outputs in batch_update.added:
            self.rows[row] = (params.extra_args["who"], outputs)
        for row in batch_update.removed:
            self.rows.pop(row, None)
        apply_moves(self.rows, batch_update.moved)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.size == len(self.rows)
        assert sorted(self.rows) == list(range(self.size))  # rows 0 .. size-1, no holes
        for row, (who, outputs) in self.rows.items():
            assert logits[row, 0].item() == who
            assert logits[row, 1].item() == len(outputs)
            logits[row, 2] = who  # what apply writes lands on the request's own row
            self.checked += 1
        return logits


def test_rows_follow_their_requests_through_any_churn() -> None:
    rng = random.Random(0)
    rec = Recording()
    batch = ProcessorBatch([rec])
    params = {k: SamplingParams(extra_args={"who": k}) for k in range(40)}
    outputs: dict[int, list[int]] = {k: [] for k in range(40)}
    live: set[int] = set()
    for _ in range(300):
        for k in list(live):  # some finish, some are not scheduled this step
            if rng.random() < 0.15:
                live.discard(k)
        live |= set(rng.sample(range(40), rng.randrange(0, 6)))
        step = [k for k in live if rng.random() < 0.8]
        rng.shuffle(step)
        if not step:
            continue
        reqs = [SampleRequest(f"s{k}", f"s{k}", i, params[k], len(outputs[k]),
                              list(outputs[k])) for i, k in enumerate(step)]
        x = torch.zeros(len(step), 4)
        x[:, 0] = torch.tensor(step, dtype=torch.float32)
        x[:, 1] = torch.tensor([len(outputs[k]) for k in step], dtype=torch.float32)
        y = batch.apply(x, reqs)
        assert y[:, 2].tolist() == [float(k) for k in step]
        assert x[:, 2].eq(0).all()  # the sampler's rows are not written in place
        for k in step:
            outputs[k].append(rng.randrange(100))
    assert rec.checked > 500


def test_greedy_batches_skip_argmax_invariant_processors() -> None:
    class Invariant(Recording):
        def is_argmax_invariant(self) -> bool:
            return True

    inv = Invariant()
    batch = ProcessorBatch([inv])
    greedy = SampleRequest("a", "a", 0, SamplingParams(temperature=0.0,
                                                       extra_args={"who": 1}), 0, [])
    sampled = SampleRequest("b", "b", 1, SamplingParams(extra_args={"who": 2}), 0, [])
    x = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0]])
    batch.apply(x[:1], [greedy])
    assert inv.checked == 0 and inv.size == 1  # state still updated
    batch.apply(x, [greedy, sampled])
    assert inv.checked == 2


def test_processor_names_load_or_are_refused_by_field() -> None:
    names = ["pagedserve.worker.testing_logits:TargetTokenProcessor",
             "pagedserve.worker.testing_logits.NoRepeatNgramProcessor"]
    assert [c.__name__ for c in load_processor_classes(names)] == [
        "TargetTokenProcessor", "NoRepeatNgramProcessor"]
    for bad, match in [("no.such.module:X", "cannot load"),
                       ("pagedserve.worker.testing_logits:Nope", "cannot load"),
                       ("pagedserve.worker.logits_processors:BatchUpdate", "not a subclass"),
                       (dict, "not a subclass")]:
        with pytest.raises(ValueError, match=f"logits_processors: .*{match}"):
            load_processor_classes([bad])
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args={1: 2})
