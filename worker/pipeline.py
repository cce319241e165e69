"""Pipeline-parallel stages: which decoder layers a stage holds, and what it hands on.

A model too large for one tensor-parallel group is cut into ``pipeline_parallel_size``
stages of consecutive layers (vLLM's ``pipeline_parallel_size``); each stage is its
own TP group. The first stage embeds the tokens, the last holds the final norm and
the LM head and samples; between them the hidden states and the residual of every
token of the step travel forward (``IntermediateTensors``). Every stage runs the same
step plan, so block tables, slots and positions are the same on all of them, and a
stage's KV pool holds only its own layers: a block costs each stage ``L_stage / L``
of what it would cost one rank holding the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def layer_partition(num_layers: int, num_stages: int, sizes: Sequence[int] | None = None
                    ) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of every stage: ``sizes`` layers each when given
    (``pipeline_layer_partition``, vLLM's ``VLLM_PP_LAYER_PARTITION``), else as even
    as they divide.

    The leftover layers go to the stages before the last, one each, counting back
    from the last but one (vLLM's split): the last stage already carries the final
    norm, the LM head and the sampler. Where the head costs several layers (a small
    model with a large vocabulary) ``sizes`` moves layers off the last stage, so the
    stages of a pipeline with plans in flight finish theirs at the same pace.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {num_stages!r}")
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size ({num_stages}) is larger than the model's "
                         f"{num_layers} layers: every stage needs at least one")
    if sizes is not None:
        check_partition(sizes, num_stages)
        if sum(sizes) != num_layers:
            raise ValueError(f"pipeline_layer_partition {list(sizes)} holds {sum(sizes)} "
                             f"layers; the model has {num_layers}")
        sizes = list(sizes)
    else:
        sizes = [num_layers // num_stages] * num_stages
        for i in range(num_layers % num_stages):
            sizes[-2 - i] += 1
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def check_partition(sizes: Sequence[int], num_stages: int) -> None:
    """``ValueError`` unless ``sizes`` gives each of ``num_stages`` stages >= 1 layer."""
    if (len(sizes) != num_stages
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)):
        raise ValueError(f"pipeline_layer_partition must be {num_stages} positive layer "
                         f"counts, one per pipeline stage, got {list(sizes)!r}")


@dataclass(frozen=True)
class PipelineStage:
    """One stage: its index among ``size`` and its layers ``[start, end)``."""

    rank: int
    size: int
    start: int
    end: int

    @classmethod
    def of(cls, num_layers: int, size: int = 1, rank: int = 0,
           sizes: Sequence[int] | None = None) -> PipelineStage:
        """Stage ``rank`` of a model of ``num_layers`` cut into ``size`` stages (of
        ``sizes`` layers, when given)."""
        if not 0 <= rank < size:
            raise ValueError(f"pipeline stage must be in [0, {size}), got {rank}")
        start, end = layer_partition(num_layers, size, sizes)[rank]
        return cls(rank, size, start, end)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass
class IntermediateTensors:
    """What a stage hands the next: every token's hidden state and residual stream.

    Sent between stages as host tensors (through Ray's object store), so a stage on
    another node needs no process group with this one.
    """

    hidden: torch.Tensor
    residual: torch.Tensor

    def to(self, device: torch.device) -> IntermediateTensors:
        return IntermediateTensors(self.hidden.to(device), self.residual.to(device))


def check_stages_fit(model_path: str, num_stages: int,
                     sizes: Sequence[int] | None = None) -> None:
    """``ValueError`` now, before any stage's actor starts, if the model at
    ``model_path`` has fewer layers than ``num_stages`` or other than ``sizes`` holds."""
    from pagedserve.worker.config import ModelConfig

    layer_partition(ModelConfig.from_pretrained(model_path).num_layers, num_stages, sizes)
