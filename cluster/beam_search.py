"""Beam search on top of the engine (vLLM's ``LLM.beam_search``).

As in vLLM, beam search is not a sampling mode inside the scheduler: each
step runs every live beam as a one-token request whose prompt is the beam so
far, asking for the ``2 * beam_width`` most likely next tokens (raw model
log-probabilities). The prefix cache turns those prompts into a lookup of
every full block already computed, so a step recomputes at most one block
per beam. The candidates of all beams of a prompt are ranked by
``get_beam_search_score`` and the best ``beam_width`` continue; a candidate
ending in EOS is set aside as a finished hypothesis (unless ``ignore_eos``).
Two beams are never merged, and the result is deterministic: candidates tie
in the order of their beams and of their log-probabilities.

Keeping the engine unaware of beams keeps every scheduler invariant (no
block shared between live requests by anything but the prefix cache) and
lets beams of many prompts share a batch with other requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.cluster.outputs import RequestOutput
from pagedserve.scheduler.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` hypotheses, at most ``max_tokens``
    new tokens each; scores are ``cum_logprob / len ** length_penalty``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        widest = MAX_LOGPROBS // 2
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= widest:
            raise ValueError(f"beam_width must be an integer in [1, {widest}], "
                             f"got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.length_penalty, bool) \
                or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, "
                             f"got {self.length_penalty!r}")


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


def get_beam_search_score(tokens: Sequence[int], cum_logprob: float,
                          eos_token_ids: Sequence[int], length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative log-probability over the length (prompt included,
    a final EOS not counted) raised to ``length_penalty``."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cum_logprob / (seq_len ** length_penalty)


# Runs one-token requests for these token lists (one output each, in order).
StepFn = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


class _Instance:
    """One prompt's search: the live beams and the hypotheses that ended."""

    def __init__(self, prompt: list[int]) -> None:
        self.beams = [BeamSearchSequence(list(prompt), num_prompt_tokens=len(prompt))]
        self.completed: list[BeamSearchSequence] = []


class BeamSearch:
    """The search state of a batch of prompts, driven one step at a time by a caller
    that runs ``pending()`` as one-token requests with ``step_params`` and hands the
    outputs to ``advance`` (the offline ``LLM`` and the async engine both do).

    A beam that fills the context (``max_model_len``) ends with ``"length"``, as
    do the survivors after ``max_tokens`` steps.
    """

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams,
                 eos_token_ids: Sequence[int], max_model_len: int) -> None:
        for p in prompts:
            if len(p) >= max_model_len:
                raise ValueError(f"prompt of {len(p)} tokens leaves no room to generate "
                                 f"(max_model_len {max_model_len})")
        self.params, self.eos, self.max_model_len = params, tuple(eos_token_ids), max_model_len
        self.instances = [_Instance(p) for p in prompts]
        self.steps = 0
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1,
                                          logprobs=2 * params.beam_width, ignore_eos=True)

    def score(self, b: BeamSearchSequence) -> float:
        return get_beam_search_score(b.tokens, b.cum_logprob, self.eos, self.params.length_penalty)

    def _live(self) -> list[tuple[_Instance, BeamSearchSequence]]:
        if self.steps >= self.params.max_tokens:
            return []
        return [(inst, beam) for inst in self.instances for beam in inst.beams]

    def pending(self) -> list[list[int]]:
        """The token lists to run next (every live beam); empty when the search is over."""
        return [beam.tokens for _, beam in self._live()]

    def advance(self, outs: Sequence[RequestOutput]) -> None:
        """Extend every live beam by its step's candidates and keep the best per prompt."""
        live = self._live()
        fresh: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in self.instances}
        for (inst, beam), out in zip(live, outs, strict=True):
            seen = dict((out.outputs[0].logprobs or [{}])[0])  # shared by the candidates
            for token, logprob in seen.items():
                cand = BeamSearchSequence(
                    [*beam.tokens, token], [*beam.logprobs, seen],
                    beam.cum_logprob + logprob, num_prompt_tokens=beam.num_prompt_tokens)
                if token in self.eos and not self.params.ignore_eos:
                    cand.finish_reason = "stop"
                    inst.completed.append(cand)
                elif len(cand.tokens) >= self.max_model_len:
                    cand.finish_reason = "length"
                    inst.completed.append(cand)
                else:
                    fresh[id(inst)].append(cand)
        for inst in self.instances:
            inst.beams = sorted(fresh[id(inst)], key=self.score,
                                reverse=True)[:self.params.beam_width]
        self.steps += 1

    def results(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the best ``beam_width`` hypotheses (ended or not), best first."""
        out = []
        for inst in self.instances:
            for beam in inst.beams:
                beam.finish_reason = "length"
            ranked = sorted(inst.completed + inst.beams, key=self.score, reverse=True)
            out.append(ranked[:self.params.beam_width])
        return out


def beam_search(step: StepFn, prompts: list[list[int]], params: BeamSearchParams,
                eos_token_ids: Sequence[int], max_model_len: int,
                decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Run the search for every prompt; ``step`` runs one batch of one-token requests.
    Each hypothesis's ``text`` is ``decode`` of its tokens (vLLM's: prompt included)."""
    search = BeamSearch(prompts, params, eos_token_ids, max_model_len)
    while batch := search.pending():
        search.advance(step(batch, search.step_params))
    results = []
    for best in search.results():
        for beam in best:
            beam.text = decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
