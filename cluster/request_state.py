"""What the engine builds for one request as steps advance it: text, tokens, logprobs,
finish reasons per sample (through incremental detokenisers), or an embedding.

Kept apart from the step loop in :mod:`engine`: this only turns the scheduler's
``RequestUpdate`` for one sequence into the vLLM-shaped outputs, and says when a
stop string ended a sequence the scheduler still runs.
"""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.cluster.detokenizer import IncrementalDetokenizer
from pagedserve.cluster.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.pooling import PoolAccumulator
from pagedserve.scheduler.beam import BeamHypothesis
from pagedserve.scheduler.outputs import RequestUpdate
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

# vLLM's RequestOutputKind. "cumulative" outputs hold everything so far; "delta" ones
# only what is new since the request's previous output (what an engine replica streams:
# a step's cost does not grow with the outputs' length); "final_only": one output, once
# finished (what LLM.generate reads).
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SequenceState:
    detok: IncrementalDetokenizer
    out: CompletionOutput


@dataclass
class RequestState:
    """One request (all its ``n`` samples, or one embedding) as the caller sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] = field(default_factory=list)  # each target's rank
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    pool: PoolAccumulator | None = None
    embedding: list[float] | None = None
    # (cache_salt, lora, image inputs) of an export_kv request
    kv_export: tuple[Any, Any, Any] | None = None
    kv_transfer: Any = None  # its KVPayload, once finished
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS (LLMEngine.add_request)
    # A "delta" request's samples: (tokens, text characters) already in an output.
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def start(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
              params: SamplingParams, num_seqs: int, tokenizer: Any,
              pool: PoolAccumulator | None = None,
              kv_export: tuple[Any, Any, Any] | None = None,
              resumed: list[int] | None = None, token_prompt: bool = True
              ) -> RequestState:
        """A request's outputs before its first step: a detokeniser per sample
        (``num_seqs``: ``n``, or a beam search's width), sample 0 begun at ``resumed``
        (``ValueError`` if they hold a stop string). Without ``token_prompt`` (a prompt
        of embeddings, its ids placeholders) the detokenisers start from no context."""
        state = cls(request_id, prompt, prompt_token_ids, params, [], pool=pool,
                    kv_export=kv_export)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
            state.prompt_ranks = [None] * len(prompt_token_ids)
        lps = params.logprobs is not None
        for i in range(num_seqs):
            detok = IncrementalDetokenizer(tokenizer, prompt_token_ids if token_prompt else (),
                                           params.stop,
                                           params.include_stop_str_in_output,
                                           params.skip_special_tokens)
            state.seqs.append(SequenceState(detok, CompletionOutput(
                index=i, logprobs=[] if lps else None,
                cumulative_logprob=0.0 if lps else None)))
        if resumed:
            state.resume(resumed)
        return state

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.seqs)

    def apply(self, i: int, u: RequestUpdate, eos_token_ids: tuple[int, ...]
              ) -> tuple[int, bool]:
        """Fold sample ``i``'s update in; returns (tokens kept, whether a stop string ended
        the sample while the scheduler still runs it)."""
        seq = self.seqs[i]
        self.num_cached_tokens = max(self.num_cached_tokens, u.num_cached_tokens)
        if u.beams is not None:
            return self._apply_beams(u.beams), False
        if self.pool is not None:
            if u.pooled is not None:
                self.pool.add(u.pooled)
            if u.finished:
                self.embedding = self.pool.result(self.prompt_token_ids)
                seq.out.finish_reason = u.finish_reason
            return 0, False
        ids = [t.token_id for t in u.new_tokens]
        stop = seq.detok.add_tokens(ids, u.finished and u.finish_reason == "stop")
        new_tokens = u.new_tokens
        if stop is not None:  # tokens past a stop string are dropped
            ids = ids[: seq.detok.num_consumed]
            new_tokens = new_tokens[: seq.detok.num_consumed]
        seq.out.token_ids.extend(ids)
        if seq.out.logprobs is not None:
            for t in new_tokens:
                # vLLM's shape: the top alternatives plus, always, the sampled token.
                entry = dict(t.top_logprobs or {})
                entry[t.token_id] = t.logprob if t.logprob is not None else 0.0
                seq.out.logprobs.append(entry)
                seq.out.cumulative_logprob += t.logprob or 0.0
        stopped_early = stop is not None and not u.finished
        if stopped_early:
            seq.out.finish_reason, seq.out.stop_reason = "stop", stop
        elif u.finished:
            seq.out.finish_reason = u.finish_reason
            if stop is not None:
                seq.out.finish_reason, seq.out.stop_reason = "stop", stop
            elif u.finish_reason == "stop" and ids and ids[-1] not in eos_token_ids:
                seq.out.stop_reason = ids[-1]
        seq.out.text = (seq.detok.text if seq.out.finish_reason is not None
                        else seq.detok.settled_text)
        return len(ids), stopped_early

    def _apply_beams(self, beams: list[BeamHypothesis]) -> int:
        """A beam search's answer: one completion per hypothesis, best first."""
        del self.seqs[len(beams):]
        for seq, h in zip(self.seqs, beams, strict=True):
            seq.detok.add_tokens(h.token_ids)
            seq.out.text = seq.detok.text
            seq.out.token_ids = list(h.token_ids)
            seq.out.logprobs = h.logprobs
            seq.out.cumulative_logprob = h.cum_logprob
            seq.out.finish_reason = h.finish_reason
        return sum(len(h.token_ids) for h in beams)

    def resume(self, token_ids: list[int]) -> None:
        """Start sample 0 from outputs another engine produced (``check_resumed``): its
        text is what those tokens decode to, as it was where they were sampled."""
        seq = self.seqs[0]
        if seq.detok.add_tokens(token_ids) is not None:
            raise ValueError("resumed_token_ids already contain a stop string: "
                             "the request ended before them")
        seq.out.token_ids.extend(token_ids)
        seq.out.text = seq.detok.settled_text
        if seq.out.logprobs is not None:  # not recomputed: the client has them already
            seq.out.logprobs.extend({} for _ in token_ids)

    def snapshot(self) -> RequestOutput:
        """The request as its caller sees it now: cumulative (copies, since the engine
        goes on appending), or for a ``"delta"`` request only what its previous
        output did not hold (slices of the new part: no copy of the whole output)."""
        if self.output_kind == "delta":
            outs = []
            for s in self.seqs:
                o = s.out
                k, c = self.sent.get(o.index, (0, 0))
                outs.append(CompletionOutput(o.index, o.text[c:], o.token_ids[k:],
                                             o.cumulative_logprob,
                                             None if o.logprobs is None else o.logprobs[k:],
                                             o.finish_reason, o.stop_reason))
                self.sent[o.index] = (len(o.token_ids), len(o.text))
        else:
            outs = [CompletionOutput(s.out.index, s.out.text, list(s.out.token_ids),
                                     s.out.cumulative_logprob,
                                     list(s.out.logprobs) if s.out.logprobs is not None
                                     else None, s.out.finish_reason, s.out.stop_reason)
                    for s in self.seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.num_cached_tokens,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                             self.embedding, self.kv_transfer,
                             None if self.prompt_logprobs is None else list(self.prompt_ranks),
                             self.output_kind == "delta")


def check_request_args(request_id: str, in_use: Container[str],
                       params: SamplingParams | None, pooling_params: PoolingParams | None,
                       beam: object | None, export_kv: bool, priority: object,
                       scheduling_policy: str, output_kind: str = "cumulative") -> None:
    """What ``LLMEngine.add_request`` refuses before looking at the prompt: conflicting
    kinds of request, a request id that is taken or holds the sequence-id separator,
    a priority the scheduling policy would ignore, an unknown output kind."""
    if output_kind not in OUTPUT_KINDS:
        raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, "
                         f"got {output_kind!r}")
    if beam is not None and (params is not None or pooling_params is not None):
        raise ValueError("a beam search takes BeamSearchParams only (params must be None)")
    if "#" in request_id:
        raise ValueError("request_id must not contain '#'")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if export_kv and (beam is not None or pooling_params is not None):
        raise ValueError("export_kv is for generation requests, not beams or embeddings")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority and scheduling_policy != "priority":
        raise ValueError("priority is set but scheduling_policy is fcfs "
                         "(start the engine with scheduling_policy='priority')")


def check_prompt_ids(prompt: list[int], vocab_size: int) -> list[int]:
    """A copy of a prompt given as token ids, or a ``ValueError`` if one is not an ``int``
    (``bool`` neither) in ``[0, vocab_size)``. Types go through a set and bounds through
    ``min`` / ``max``, loops in C: a 32k-token prompt is checked on the event loop."""
    ids = list(prompt)
    if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError("prompt token ids must be integers within the vocabulary")
    return ids


def check_resumed(token_ids: list[int] | None, params: SamplingParams, prompt_len: int,
                  max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                  special: bool) -> list[int]:
    """Validate outputs a request resumes from (``LLMEngine.add_request``); ``special``:
    a beam search, an embedding or a KV export, which do not resume. Returns the list
    (empty for None); a ``ValueError`` names ``resumed_token_ids`` otherwise."""
    if not token_ids:
        return []
    if special or params.n != 1:
        raise ValueError("resumed_token_ids: only a single-sample generation (n=1, no beam "
                         "search, embedding or KV export) resumes")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
               for t in token_ids):
        raise ValueError("resumed_token_ids must be integers within the vocabulary")
    if params.max_tokens is not None and len(token_ids) >= params.max_tokens:
        raise ValueError(f"resumed_token_ids: {len(token_ids)} tokens leave none of "
                         f"max_tokens={params.max_tokens} to generate")
    if prompt_len + len(token_ids) >= max_model_len:
        raise ValueError(f"resumed_token_ids: prompt and outputs are "
                         f"{prompt_len + len(token_ids)} tokens, the model's context is "
                         f"{max_model_len}")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if stops & set(token_ids):
        raise ValueError("resumed_token_ids contain a stop token: the request ended there")
    return list(token_ids)


def with_bad_word_ids(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """``params`` with ``bad_words`` tokenized (``bad_words_token_ids``), as vLLM does:
    each word as written and after a space (its spelling mid-text), so neither form
    can be generated. Explicit ``bad_words_token_ids`` are kept."""
    if not params.bad_words:
        return params
    seqs = [list(ids) for ids in params.bad_words_token_ids or []]
    for word in params.bad_words:
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return replace(params, bad_words_token_ids=seqs)
