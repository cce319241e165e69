"""Beam search's public types (vLLM's ``LLM.beam_search`` API).

The search itself runs inside the scheduler (``scheduler/beam.py``): a beam
search is one engine request whose beams are sequences that fork on each
other's KV blocks, so each step computes one token per live beam and the
beams share batches with everything else. Its answer is a ``RequestOutput``
with one completion per hypothesis, best first; ``beam_sequences`` turns that
into vLLM's ``BeamSearchSequence`` objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.cluster.outputs import RequestOutput
from pagedserve.scheduler.beam import BeamSearchParams, get_beam_search_score
from pagedserve.scheduler.sampling_params import SamplingParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "beam_row_params", "beam_sequences", "get_beam_search_score"]


@dataclass
class BeamSearchSequence:
    """One hypothesis. As in vLLM, ``tokens`` (and ``text``) include the prompt;
    ``logprobs`` has one entry per generated token: the candidates its step saw."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (ended in EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated tokens only."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_row_params(params: BeamSearchParams, prompt_len: int, max_model_len: int
                    ) -> SamplingParams:
    """What each beam's row samples with: greedy, reporting the ``2 * beam_width``
    likeliest tokens (raw log-probabilities); the group, not the row, decides when a
    beam stops, and a beam that fills the context ends with ``"length"``."""
    room = max(1, max_model_len - prompt_len)
    return SamplingParams(temperature=0.0, max_tokens=min(params.max_tokens, room),
                          logprobs=2 * params.beam_width, ignore_eos=True)


def beam_sequences(out: RequestOutput, decode: Callable[[list[int]], str] | None = None
                   ) -> list[BeamSearchSequence]:
    """A finished beam search request's hypotheses, best first; ``text`` is ``decode``
    of the tokens, prompt included (vLLM's), when given."""
    prompt = list(out.prompt_token_ids)
    seqs = []
    for c in out.outputs:
        tokens = prompt + list(c.token_ids)
        seqs.append(BeamSearchSequence(tokens, list(c.logprobs or []),
                                       c.cumulative_logprob or 0.0,
                                       decode(tokens) if decode is not None else None,
                                       c.finish_reason, len(prompt)))
    return seqs
