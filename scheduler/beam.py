"""Beam search inside the scheduler: the search state of one prompt (``BeamGroup``).

Live beams are ordinary sequences of one group. Each step every live beam runs
one decode row whose sampler reports the ``2 * beam_width`` likeliest next
tokens (raw model log-probabilities); the beam then waits, *held* (nothing
left to compute), until every live beam of its group has reported. The group
then ranks all candidates by ``get_beam_search_score``: a candidate ending in
EOS (unless ``ignore_eos``) or filling the context becomes a finished
hypothesis, the best ``beam_width`` others continue. The scheduler
(:class:`beam_scheduling.BeamScheduling`) turns that choice into block
operations: a beam chosen once keeps its sequence and appends the token; a
beam chosen again forks a new sequence on its blocks (the partial last block
copy-on-write, as for ``n > 1``); a beam not chosen ends and frees its blocks.
So a step computes one token per beam, where re-submitting every beam as a
new prompt (vLLM's ``LLM.beam_search``) recomputes its partial last block.

Candidates tie in the order of their beams and of their log-probabilities,
so results are deterministic and equal to the one-request-per-beam search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.scheduler.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from pagedserve.scheduler.request import Request


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


def get_beam_search_score(tokens: Sequence[int], cum_logprob: float,
                          eos_token_ids: Sequence[int], length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative log-probability over the length (prompt included,
    a final EOS not counted) raised to ``length_penalty``."""
    ends_in_eos = bool(tokens) and tokens[-1] in eos_token_ids
    return _score(len(tokens), ends_in_eos, cum_logprob, length_penalty)


def _score(num_tokens: int, ends_in_eos: bool, cum_logprob: float,
           length_penalty: float) -> float:
    return cum_logprob / ((num_tokens - ends_in_eos) ** length_penalty)


# A beam's per-step candidate dicts as a persistent list (earlier steps, this
# step's dict): a fork shares its parent's history instead of copying it.
Trail = tuple["Trail", dict[int, float]] | None


def unroll(trail: Trail) -> list[dict[int, float]]:
    """The trail's dicts, first step first."""
    out: list[dict[int, float]] = []
    while trail is not None:
        trail, seen = trail
        out.append(seen)
    out.reverse()
    return out


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens, the candidates each step saw, its
    cumulative log-probability, ``"stop"`` (ended in EOS) or ``"length"``, and score."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    finish_reason: str
    score: float


@dataclass(slots=True)
class Candidate:
    """One continuation of a live beam: the first ``num_tokens - 1`` tokens of
    ``parent`` (a prefix that never changes: a sequence only grows) plus ``token``."""

    parent: Request
    num_tokens: int
    token: int
    cum_logprob: float
    trail: Trail
    score: float


class BeamGroup:
    """One prompt's search: the live beams in rank order, what each reported this
    round, and the hypotheses that ended."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_model_len: int) -> None:
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.live: list[Request] = []
        self.cum: dict[str, float] = {}
        self.trail: dict[str, Trail] = {}
        self.seen: dict[str, dict[int, float]] = {}  # this round's candidates per beam
        self.completed: list[tuple[Candidate, str]] = []  # ended, and why
        self.steps = 0
        self.num_forks = 0
        self.num_cached_tokens = 0

    def start(self, first: Request) -> None:
        self.live = [first]
        self.cum = {first.request_id: 0.0}
        self.trail = {first.request_id: None}

    def is_held(self, req: Request) -> bool:
        """Whether ``req`` reported this round and waits for its siblings."""
        return req.request_id in self.seen

    def report(self, req: Request, seen: dict[int, float]) -> bool:
        """Record a beam's candidates; True once every live beam has reported."""
        self.seen[req.request_id] = seen
        self.num_cached_tokens = max(self.num_cached_tokens, req.num_cached_tokens)
        return len(self.seen) == len(self.live)

    def select(self) -> list[Candidate]:
        """Rank this round's candidates: set the ended ones aside, return the best
        ``beam_width`` others, best first; the round is over."""
        fresh: list[Candidate] = []
        eos = () if self.params.ignore_eos else self.eos
        for beam in self.live:
            rid = beam.request_id
            seen, base = self.seen[rid], self.cum[rid]
            trail = (self.trail[rid], seen)
            n = beam.num_tokens + 1
            for token, logprob in seen.items():
                cand = Candidate(beam, n, token, base + logprob, trail,
                                 _score(n, token in self.eos, base + logprob,
                                        self.params.length_penalty))
                if token in eos:
                    self.completed.append((cand, "stop"))
                elif n >= self.max_model_len:
                    self.completed.append((cand, "length"))
                else:
                    fresh.append(cand)
        self.seen.clear()
        self.steps += 1
        return sorted(fresh, key=lambda c: c.score, reverse=True)[:self.params.beam_width]

    def is_over(self, chosen: list[Candidate]) -> bool:
        return not chosen or self.steps >= self.params.max_tokens

    @staticmethod
    def hypothesis(cand: Candidate, reason: str) -> BeamHypothesis:
        parent = cand.parent
        tokens = parent.all_token_ids[parent.num_prompt_tokens:cand.num_tokens - 1]
        tokens.append(cand.token)
        return BeamHypothesis(tokens, unroll(cand.trail), cand.cum_logprob, reason, cand.score)

    def continue_with(self, beams: list[Request], chosen: list[Candidate]) -> None:
        """The next round's live beams (``beams[i]`` continues ``chosen[i]``)."""
        self.live = beams
        self.cum = {b.request_id: c.cum_logprob for b, c in zip(beams, chosen, strict=True)}
        self.trail = {b.request_id: c.trail for b, c in zip(beams, chosen, strict=True)}

    def results(self, chosen: list[Candidate]) -> list[BeamHypothesis]:
        """The best ``beam_width`` of the ended hypotheses and the last round's choice."""
        ranked = sorted(self.completed + [(c, "length") for c in chosen],
                        key=lambda e: e[0].score, reverse=True)
        return [self.hypothesis(c, why) for c, why in ranked[:self.params.beam_width]]
