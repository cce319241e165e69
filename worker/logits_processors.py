"""Custom logits processors, vLLM's V1 interface (``--logits-processors``).

A processor is a class loaded once per engine (``LLM(logits_processors=[Cls])``, or
``"pkg.module:Cls"`` / ``"pkg.module.Cls"`` strings, as vLLM takes them) and run on
the sampling rank over the whole batch: ``apply(logits)`` gets ``[batch, vocab]``
rows, and ``update_state(batch_update)`` tells it, before each step's ``apply``,
which requests joined the batch at which row (with their ``SamplingParams``, whose
``extra_args`` carry per-request settings: HTTP's ``vllm_xargs``), which left, and
which moved. ``validate_params`` (a class method) refuses a request's settings
when it arrives. ``AdapterLogitsProcessor`` wraps per-request callables
``fn(output_ids, row)`` / ``fn(prompt_ids, output_ids, row)``. A processor written
for vLLM runs here with its import changed to this module.

This engine's sampler has no persistent batch: each step it gets the rows the
plan samples, in the plan's order. ``ProcessorBatch`` keeps one, as vLLM's input
batch does, so processors see vLLM's bookkeeping: a new request takes the lowest
freed row, else the next; freed rows left over are filled from the end
(one-way moves), so rows ``0 .. batch_size - 1`` are always occupied; the logits
are permuted into that order for ``apply`` and back. Each request's output ids
are one live list per request, extended every step (the plan carries the history
while processors are loaded). Logprobs stay those of the raw logits.

Not with speculative decoding (a request then owns several rows a step; vLLM
refuses the combination too).
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.worker.sampler import SampleRequest


class MoveDirectionality(Enum):
    """A one-way move (row ``a``'s request to row ``b``) or a swap of two rows."""

    UNIDIRECTIONAL = 0
    SWAP = 1


# (row, params, prompt ids or None, live output ids) of a request joining the batch.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
# (row a, row b, directionality)
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since the last step. Processors apply ``added``
    (each overwrites its row), then drop ``removed``, then apply ``moved`` in order."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True)
class ProcessorConfig:
    """What a processor's constructor gets where vLLM passes its ``VllmConfig``: the
    facts processors read from it, also under vLLM's attribute paths
    (``model_config.max_model_len``, ``scheduler_config.max_num_seqs``...)."""

    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int

    @property
    def model_config(self) -> SimpleNamespace:
        return SimpleNamespace(model=self.model, max_model_len=self.max_model_len,
                               get_vocab_size=lambda: self.vocab_size)

    @property
    def scheduler_config(self) -> SimpleNamespace:
        return SimpleNamespace(max_num_seqs=self.max_num_seqs)


class LogitsProcessor(ABC):
    """vLLM's V1 ``LogitsProcessor`` (see the module docstring)."""

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Built once per engine, on the rank that samples."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ``ValueError`` if ``params`` (its ``extra_args``) are not this
        processor's; runs as a request arrives, before it is queued (optional)."""
        return None

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits ``[batch_size, vocab]`` after this processor (in place
        or a new tensor)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if it never changes a row's argmax: skipped when every row is greedy."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Fold in the batch's changes (None: none) before this step's ``apply``."""


RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor over per-request callables: ``new_req_logits_processor``
    gives each request's (or None), called on its row as ``fn(output_ids, row)`` or,
    taking three arguments, ``fn(prompt_ids, output_ids, row)``."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.config, self.device = config, device
        self._fns: dict[int, tuple[RequestLogitsProcessor, list[int] | None, list[int],
                                   bool]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams
                                 ) -> RequestLogitsProcessor | None:
        """The callable for a request with ``params`` (None: leave its row alone)."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row, params, prompt, outputs in batch_update.added:
            fn = self.new_req_logits_processor(params)
            if fn is None:
                self._fns.pop(row, None)
            else:
                self._fns[row] = (fn, prompt, outputs,
                                  len(inspect.signature(fn).parameters) == 3)
        for row in batch_update.removed:
            self._fns.pop(row, None)
        apply_moves(self._fns, batch_update.moved)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (fn, prompt, outputs, with_prompt) in self._fns.items():
            args = (prompt or [], outputs) if with_prompt else (outputs,)
            logits[row] = fn(*args, logits[row])
        return logits


def apply_moves(state: dict[int, Any], moved: Sequence[MovedRequest]) -> None:
    """Row-keyed processor state after ``moved`` (what every processor does with it)."""
    for a, b, how in moved:
        va, vb = state.pop(a, None), state.pop(b, None)
        if va is not None:
            state[b] = va
        if how is MoveDirectionality.SWAP and vb is not None:
            state[a] = vb


def load_processor_classes(specs: Iterable[str | type] | None) -> list[type]:
    """The processor classes ``specs`` name (``"pkg.mod:Cls"``, ``"pkg.mod.Cls"`` or a
    class); ``ValueError`` naming ``logits_processors`` for one that does not load or
    is not a ``LogitsProcessor``."""
    classes = []
    for spec in specs or ():
        cls = spec
        if isinstance(spec, str):
            module, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"logits_processors: cannot load {spec!r} "
                                 f"({type(e).__name__}: {e})") from None
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {spec!r} is not a subclass of "
                             "pagedserve.worker.logits_processors.LogitsProcessor")
        classes.append(cls)
    return classes


def check_engine_processors(specs: Sequence[str | type], speculative: Any) -> None:
    """An engine's ``logits_processors`` load, and no speculative decoding beside them."""
    load_processor_classes(specs)
    if speculative is not None:
        raise ValueError("logits_processors: custom logits processors are not supported "
                         "with speculative decoding (speculative_config)")


def check_params(classes: Sequence[type], params: SamplingParams) -> None:
    """Every loaded processor's ``validate_params`` on a request's params."""
    for cls in classes:
        cls.validate_params(params)  # type: ignore[attr-defined]


class ProcessorBatch:
    """The loaded processors and the persistent batch they see (module docstring)."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        self._rows: list[str | None] = []  # sample id per batch row
        self._outputs: dict[str, list[int]] = {}

    def forget(self, sample_ids: Iterable[str]) -> None:
        """Drop finished or aborted samples' output lists (their rows are freed at
        the next step that does not sample them)."""
        for sid in sample_ids:
            self._outputs.pop(sid, None)

    def apply(self, x: torch.Tensor, reqs: Sequence[SampleRequest], owned: bool = False
              ) -> torch.Tensor:
        """``x`` (one row per entry of ``reqs``) after every processor, its rows in
        the persistent batch's order while they run. ``owned``: ``x`` is the caller's
        own copy, which may be written (else it is left as it is)."""
        order = self._update(reqs)
        greedy = all(r.params.greedy for r in reqs)
        active = [p for p in self.processors if not (greedy and p.is_argmax_invariant())]
        if not active:
            return x
        if order == list(range(len(order))):  # rows already in the batch's order
            y = x if owned else x.clone()
            for p in active:
                y = p.apply(y)
            return y
        index = torch.tensor(order, device=x.device)
        y = x.index_select(0, index)
        for p in active:
            y = p.apply(y)
        out = x if owned else x.clone()
        out[index] = y
        return out

    def _update(self, reqs: Sequence[SampleRequest]) -> list[int]:
        """Tell the processors how the batch changed; the entry index of each row."""
        want = {r.sample_id: i for i, r in enumerate(reqs)}
        if len(want) != len(reqs):
            raise ValueError("custom logits processors take one row per sample "
                             "(not speculative decoding's several)")
        removed = [i for i, sid in enumerate(self._rows) if sid not in want]
        for i in removed:
            self._rows[i] = None
        free = sorted(removed)
        held = set(self._rows)
        added: list[AddedRequest] = []
        for r in reqs:
            live = self._live(r)
            if r.sample_id in held:
                continue
            row = free.pop(0) if free else len(self._rows)
            if row == len(self._rows):
                self._rows.append(None)
            self._rows[row] = r.sample_id
            added.append((row, r.params, r.prompt_token_ids, live))
        removed = [i for i in removed if self._rows[i] is None]
        moved: list[MovedRequest] = []
        for hole in sorted(removed):  # fill what is left from the end, as vLLM condenses
            while self._rows and self._rows[-1] is None:
                self._rows.pop()
            if hole >= len(self._rows):
                break
            last = len(self._rows) - 1
            self._rows[hole] = self._rows.pop()
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        while self._rows and self._rows[-1] is None:
            self._rows.pop()
        update = BatchUpdate(len(self._rows), removed, added, moved) \
            if removed or added or moved else None
        for p in self.processors:
            p.update_state(update)
        return [want[sid] for sid in self._rows]  # type: ignore[index]

    def _live(self, r: SampleRequest) -> list[int]:
        """The sample's live output list, brought up to the plan's history."""
        live = self._outputs.setdefault(r.sample_id, [])
        hist = r.output_token_ids
        if hist is not None and len(hist) != len(live):
            if len(hist) > len(live):
                live.extend(hist[len(live):])
            else:
                del live[len(hist):]
        return live


def build_processors(specs: Iterable[str | type], config: ProcessorConfig,
                     device: torch.device) -> ProcessorBatch | None:
    """The engine's processors, built on the sampling rank (None: none loaded)."""
    classes = load_processor_classes(specs)
    if not classes:
        return None
    return ProcessorBatch([cls(config, device, False) for cls in classes])
