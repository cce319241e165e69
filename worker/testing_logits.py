"""Two custom logits processors, importable by name on any rank (tests, examples):
one batch-level (vLLM's ``DummyLogitsProcessor``: ``extra_args={"target_token": t}``
forces that token) and one per request through the adapter (Hugging Face's
``no_repeat_ngram_size``, from ``extra_args``, over the prompt and output ids)."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.logits_processors import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    RequestLogitsProcessor,
    apply_moves,
)


def _int_arg(params: SamplingParams, key: str, lo: int) -> int | None:
    value = (params.extra_args or {}).get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < lo):
        raise ValueError(f"extra_args.{key} must be an integer >= {lo}, got {value!r}")
    return value


class TargetTokenProcessor(LogitsProcessor):
    """Rows whose request set ``extra_args["target_token"]`` keep only that token."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vocab_size = config.model_config.get_vocab_size()
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _int_arg(params, "target_token", 0)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row, params, _, _ in batch_update.added:
            target = _int_arg(params, "target_token", 0)
            if target is None:
                self.targets.pop(row, None)
            else:
                self.targets[row] = min(target, self.vocab_size - 1)
        for row in batch_update.removed:
            self.targets.pop(row, None)
        apply_moves(self.targets, batch_update.moved)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, target in self.targets.items():
            keep = logits[row, target].item()
            logits[row].fill_(float("-inf"))
            logits[row, target] = keep
        return logits


class NoRepeatNgramProcessor(AdapterLogitsProcessor):
    """Hugging Face's ``no_repeat_ngram_size`` per request: a token that would repeat
    an n-gram of the prompt and output so far is never drawn."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _int_arg(params, "no_repeat_ngram_size", 1)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams
                                 ) -> RequestLogitsProcessor | None:
        n = _int_arg(params, "no_repeat_ngram_size", 1)
        if n is None:
            return None

        def ban(prompt: list[int], outputs: list[int], row: torch.Tensor) -> torch.Tensor:
            ids = prompt + outputs
            if len(ids) + 1 < n:
                return row
            head = tuple(ids[len(ids) - n + 1:]) if n > 1 else ()
            banned = [ids[i + n - 1] for i in range(len(ids) - n + 1)
                      if tuple(ids[i:i + n - 1]) == head]
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
            return row

        return ban
