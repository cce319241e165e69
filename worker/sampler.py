"""Token sampling on rank 0: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs,
``allowed_token_ids``, ``min_tokens``, ``bad_words``, ``logit_bias``, presence / frequency /
repetition penalties, and structured outputs (grammar masks, :mod:`structured`).

The tensor math lives in :mod:`sampling_ops`; this class owns the per-request
state. A draw is an inverse-CDF lookup (one uniform per row, a cumulative sum
and a binary search), an exact categorical sample that costs a tenth of the
exponential race ``argmax(p / E)`` over a 49k vocabulary. A seeded request
takes the uniform of its output position ``p`` from ``(seed, p)`` alone
(:func:`seeded_uniform`) and is drawn on its own row with row-wise kernels only,
so its tokens depend only on its own logits, seed and position: the same alone
or in any batch, after a preemption, resumed on another replica from the tokens
it had sent, and with or without speculative decoding's guesses (no generator
state advances by how many draws a step made). Logprobs are those of the raw
model distribution (vLLM's default), before temperature or truncation.
``sample_drafted`` verifies speculative decoding's guesses (every position of a
drafted row is drawn, position ``done + j`` from its own uniform).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.scheduler.outputs import SampledToken
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampling_ops import apply_min_p, penalize_row, sample_rows
from pagedserve.worker.spec_sampling import target_probs, verify

if TYPE_CHECKING:
    from pagedserve.worker.logits_processors import ProcessorBatch
    from pagedserve.worker.structured import GrammarBook


@dataclass(slots=True)
class SampleRequest:
    """One sequence that draws a token from row ``row`` of the logits."""

    sample_id: str
    request_id: str
    row: int
    params: SamplingParams
    num_output_tokens: int | None = None
    output_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # Speculative decoding: guesses verified on rows ``row .. row + len(drafts)``.
    draft_token_ids: list[int] | None = None
    # (set by the sampler on a drafted row's positions: the guesses before this one,
    # already at the end of ``output_token_ids``; a grammar takes them tentatively)
    draft_prefix: list[int] | None = None
    # A draft model's distributions the guesses were drawn from (``[k, vocab]``):
    # verified by speculative sampling's rule (``spec_sampling``); None: drawn and
    # matched, which is that rule for guesses that are one fixed token.
    draft_probs: torch.Tensor | None = None


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64: a bijective 64-bit mix, so nearby inputs give unrelated
    outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) a request seeded with ``seed`` draws its output token
    ``position`` with: 24 bits (exact in fp32, never 1.0), a function of the two
    numbers only, the same on every device and rank."""
    return (_splitmix64(_splitmix64(seed) ^ position) >> 40) / float(1 << 24)


class Sampler:
    """Stateful only for grammar matchers and, for callers that do not say a
    sequence's output count (``SampleRequest.num_output_tokens``), a count of its
    draws; both dropped on finish/abort."""

    def __init__(self, eos_token_ids: Iterable[int] = (),
                 grammar_book: Callable[[], GrammarBook] | None = None,
                 processors: ProcessorBatch | None = None):
        """``grammar_book`` builds the structured-output state on the first constrained
        request (it loads the tokenizer); without it such requests are refused.
        ``processors``: custom logits processors, after the built-in ones."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.processors = processors
        self._counts: dict[str, int] = {}
        self._children: dict[str, set[str]] = {}
        self._make_book = grammar_book
        self._book: GrammarBook | None = None

    def forget(self, ids: Iterable[str]) -> None:
        """Drop state of finished or aborted requests (and of their forked sample ids)."""
        for rid in ids:
            sids = self._children.pop(rid, set()) | {rid}
            if self.processors is not None:
                self.processors.forget(sids)
            for sid in sids:
                self._counts.pop(sid, None)
                if self._book is not None:
                    self._book.forget(sid)

    @property
    def num_tracked(self) -> int:
        book = 0 if self._book is None else self._book.num_tracked
        return len(self._counts) + book

    def _done(self, r: SampleRequest) -> int:
        """Output tokens ``r``'s sequence has before this draw (the plan says; else
        this sampler's count)."""
        done = r.num_output_tokens
        return self._counts.get(r.sample_id, 0) if done is None else done

    def sample(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> dict[str, SampledToken]:
        """Draw one token per entry of ``reqs`` from ``logits[row]``; several may share a row."""
        if not reqs:
            return {}
        tokens = self._draw(logits, reqs)
        for r, t in zip(reqs, tokens):
            self._counts[r.sample_id] = self._counts.get(r.sample_id, 0) + 1
            if r.params.structured_outputs is not None:
                assert self._book is not None
                self._book.accept(r.sample_id, t.token_id)
        out = {r.sample_id: t for r, t in zip(reqs, tokens)}
        assert len(out) == len(reqs), "duplicate sample ids in one step"
        return out

    def sample_drafted(self, logits: torch.Tensor, reqs: list[SampleRequest]
                       ) -> dict[str, list[SampledToken]]:
        """Verify draft tokens: entry ``r`` draws a token at each of its rows
        ``r.row + j`` as if the drafts before ``j`` were its output, keeps the
        drafts up to the first draw that differs, and ends with that draw.

        For a draft that is one fixed token (n-gram lookup), this is exactly
        speculative sampling's rule: the draft survives with the target
        probability of drawing it, and a rejected position's draw, conditioned
        on differing, comes from the target distribution with the draft taken
        out, i.e. the residual ``max(0, p - q)`` normalised. So outputs follow
        the same distribution as decoding one token per step (greedy: the same
        tokens). A grammar masks each position in the state the guesses before it
        lead to (taken tentatively and rolled back), then accepts the kept tokens.
        """
        expanded: list[SampleRequest] = []
        for r in reqs:
            drafts = r.draft_token_ids or []
            done = self._done(r)
            hist = r.output_token_ids
            for j in range(len(drafts) + 1):
                expanded.append(SampleRequest(
                    r.sample_id, r.request_id, r.row + j, r.params, done + j,
                    None if hist is None else hist + drafts[:j], r.prompt_token_ids,
                    draft_prefix=drafts[:j] or None))
        ruled = [_by_rule(r) for r in reqs]
        spans, at = [], 0
        for r in reqs:
            spans.append((at, at + len(r.draft_token_ids or []) + 1))
            at = spans[-1][1]
        matched = [i for (a, b), by_rule in zip(spans, ruled) if not by_rule
                   for i in range(a, b)]
        tokens: list[SampledToken | None] = [None] * len(expanded)
        if matched:
            for i, t in zip(matched, self._draw(logits, [expanded[i] for i in matched])):
                tokens[i] = t
        kept = self._verify_by_rule(logits, reqs, expanded, spans, ruled) if any(ruled) else {}
        out: dict[str, list[SampledToken]] = {}
        for i, (r, (a, b)) in enumerate(zip(reqs, spans)):
            if i in kept:
                out[r.sample_id] = kept[i]
            else:
                drafts = r.draft_token_ids or []
                mine = tokens[a:b]
                keep = 0
                while keep < len(drafts) and mine[keep].token_id == drafts[keep]:  # type: ignore[union-attr]
                    keep += 1
                out[r.sample_id] = mine[:keep + 1]  # type: ignore[assignment]
            self._counts[r.sample_id] = self._counts.get(r.sample_id, 0) + len(out[r.sample_id])
            if r.params.structured_outputs is not None:
                assert self._book is not None
                for t in out[r.sample_id]:
                    self._book.accept(r.sample_id, t.token_id)
        return out

    def _verify_by_rule(self, logits: torch.Tensor, reqs: list[SampleRequest],
                        expanded: list[SampleRequest], spans: list[tuple[int, int]],
                        ruled: list[bool]) -> dict[int, list[SampledToken]]:
        """Speculative sampling's rule for the entries whose guesses a draft model drew
        from its ``draft_probs``: entry index -> its kept guesses, then the target's
        own token (logprobs, when asked, of the raw rows as for any draw)."""
        rows = [i for (a, b), by_rule in zip(spans, ruled) if by_rule for i in range(a, b)]
        sub = [expanded[i] for i in rows]
        raw, x = self._processed(logits, sub)
        probs = target_probs(x, [e.params for e in sub])
        out: dict[int, list[SampledToken]] = {}
        chosen: list[SampledToken] = []
        at = 0
        for i, (r, (a, b), by_rule) in enumerate(zip(reqs, spans, ruled)):
            if not by_rule:
                continue
            n = b - a
            assert r.draft_probs is not None and r.draft_token_ids is not None
            p = probs[at:at + n]
            out[i] = [SampledToken(t) for t in verify(p, r.draft_probs, r.draft_token_ids)]
            # (positions past the kept ones are scored on a stand-in token, then dropped)
            chosen += out[i] + [SampledToken(0) for _ in range(n - len(out[i]))]
            at += n
        logprob_rows = [j for j, r in enumerate(sub) if r.params.logprobs is not None]
        if logprob_rows:
            ids = torch.tensor([t.token_id for t in chosen], device=raw.device)
            self._add_logprobs(raw, ids, sub, logprob_rows, chosen)
        return out

    def _processed(self, logits: torch.Tensor, reqs: list[SampleRequest]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's raw row (fp32) and its row after the processors and its
        grammar's mask, before temperature and truncation."""
        rows = [r.row for r in reqs]
        if rows == list(range(logits.shape[0])):
            raw = logits.float()
        else:
            raw = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
        for r in reqs:
            if r.request_id != r.sample_id:
                self._children.setdefault(r.request_id, set()).add(r.sample_id)
        x = self._process_logits(raw, reqs)
        if self.processors is not None:
            x = self.processors.apply(x, reqs, owned=x is not raw)
        constrained = [i for i, r in enumerate(reqs) if r.params.structured_outputs is not None]
        if constrained:
            x = self._apply_grammars(raw, x, reqs, constrained)
        return raw, x

    def _draw(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SampledToken]:
        """One token per entry. Only seeded generators advance here; counting the
        tokens and feeding them to grammars is the caller's (a drafted row keeps
        only some of its draws)."""
        raw, x = self._processed(logits, reqs)
        greedy = [r.params.greedy for r in reqs]
        if all(greedy):
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample_random(x, reqs, greedy)
        out = [SampledToken(t) for t in tokens.tolist()]
        logprob_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if logprob_rows:
            self._add_logprobs(raw, tokens, reqs, logprob_rows, out)
        return out

    def _process_logits(self, raw: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
        """vLLM's order: keep only ``allowed_token_ids``, forbid EOS and stop tokens
        before ``min_tokens``, add ``logit_bias``, then the repetition, frequency and
        presence penalties.

        Rows without any of these are left alone (and ``raw`` is not copied).
        """
        x = raw
        for i, r in enumerate(reqs):
            p = r.params
            banned = self._banned(r)
            allowed = p.allowed_token_ids
            if allowed is not None and banned and set(allowed) <= set(banned):
                banned = []  # the ban would leave nothing to draw: the allowed set wins
            if not (banned or allowed or p.logit_bias or p.uses_penalties):
                continue
            if x is raw:
                x = raw.clone()
            row = x[i]
            if allowed is not None:
                keep = torch.full_like(row, float("-inf"))
                ids = torch.tensor(allowed, device=x.device)
                keep[ids] = row[ids]
                row.copy_(keep)
            if banned:
                row[torch.tensor(banned, device=x.device)] = float("-inf")
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=x.device)
                row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()),
                                                    device=x.device, dtype=x.dtype))
            if p.uses_penalties:
                penalize_row(row, r.output_token_ids or [], r.prompt_token_ids or [],
                             p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        return x

    def _apply_grammars(self, raw: torch.Tensor, x: torch.Tensor, reqs: list[SampleRequest],
                        rows: list[int]) -> torch.Tensor:
        """Mask what each constrained row's grammar forbids. A row left with nothing
        (``min_tokens`` banning the end a complete output needs, ``allowed_token_ids``
        the grammar cannot use) keeps only the grammar's mask: the output stays valid."""
        if self._book is None:
            if self._make_book is None:
                raise ValueError("structured_outputs: this worker has no tokenizer for grammars")
            self._book = self._make_book()
        if x is raw:
            x = raw.clone()
        plain = [i for i in rows if not reqs[i].draft_prefix]
        matchers = []
        for i in plain:
            r = reqs[i]
            assert r.params.structured_outputs is not None
            matchers.append(self._book.sync(r.sample_id, r.params.structured_outputs,
                                            r.output_token_ids))
        self._mask(raw, x, plain, matchers)
        for i in rows:  # positions after guesses: the matcher in the state they lead to
            r = reqs[i]
            if not r.draft_prefix:
                continue
            assert r.params.structured_outputs is not None and r.output_token_ids is not None
            base = r.output_token_ids[: len(r.output_token_ids) - len(r.draft_prefix)]
            m = self._book.sync(r.sample_id, r.params.structured_outputs, base)
            taken = self._book.advance(m, r.draft_prefix)
            self._mask(raw, x, [i], [m])
            if taken:
                m.rollback(taken)
        return x

    def _mask(self, raw: torch.Tensor, x: torch.Tensor, rows: list[int], matchers: list[Any]
              ) -> None:
        assert self._book is not None
        self._book.mask_rows(x, rows, matchers)
        empty = [i for i in rows if not torch.isfinite(x[i]).any()]
        if empty:
            x[empty] = raw[empty]
            self._book.mask_rows(x, empty, [matchers[rows.index(i)] for i in empty])

    def _banned(self, r: SampleRequest) -> list[int]:
        """Tokens a sequence may not draw now: EOS and stop ids before ``min_tokens``,
        and the last token of every bad word whose other tokens end the output."""
        p = r.params
        banned: list[int] = []
        if p.bad_words_token_ids:
            out = r.output_token_ids or []
            for ids in p.bad_words_token_ids:
                head = len(ids) - 1
                if head == 0 or (len(out) >= head and out[len(out) - head:] == ids[:-1]):
                    banned.append(ids[-1])
        if p.min_tokens <= 0 or self._done(r) >= p.min_tokens:
            return banned
        return banned + list(p.stop_token_ids) + ([] if p.ignore_eos
                                                  else list(self.eos_token_ids))

    def _sample_random(self, x: torch.Tensor, reqs: list[SampleRequest], greedy: list[bool]
                       ) -> torch.Tensor:
        dev = x.device
        idx = [i for i, g in enumerate(greedy) if not g]
        sub = [reqs[i] for i in idx]
        idx_t = torch.tensor(idx, device=dev)
        z = x if len(idx) == len(reqs) else x.index_select(0, idx_t)
        temps = torch.tensor([r.params.temperature for r in sub], device=dev, dtype=x.dtype)
        u = torch.rand(len(sub), device=dev)
        own_row = [r.params.seed is not None for r in sub]
        seeded = [j for j, own in enumerate(own_row) if own]
        if seeded:
            u[torch.tensor(seeded, device=dev)] = torch.tensor(
                [seeded_uniform(sub[j].params.seed, self._done(sub[j]))  # type: ignore[arg-type]
                 for j in seeded], device=dev, dtype=u.dtype)
        z = z / temps.unsqueeze(1)
        min_p = [r.params.min_p for r in sub]
        if any(min_p):
            z = apply_min_p(z, min_p)
        drawn = sample_rows(z, [r.params.top_k for r in sub], [r.params.top_p for r in sub],
                            u, own_row)
        if len(idx) == len(reqs):
            return drawn
        tokens = x.argmax(dim=-1)
        tokens[idx_t] = drawn
        return tokens

    @staticmethod
    def _add_logprobs(raw: torch.Tensor, tokens: torch.Tensor, reqs: list[SampleRequest],
                      rows: list[int], out: list[SampledToken]) -> None:
        rows_t = torch.tensor(rows, device=raw.device)
        lp = torch.log_softmax(raw.index_select(0, rows_t), dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, rows_t).unsqueeze(1)).squeeze(1).tolist()
        k = max(reqs[i].params.logprobs or 0 for i in rows)
        top_v = top_i = None
        if k > 0:
            tv, ti = lp.topk(k, dim=-1)
            top_v, top_i = tv.tolist(), ti.tolist()
        for j, i in enumerate(rows):
            st = out[i]
            st.logprob = chosen[j]
            n_top = reqs[i].params.logprobs or 0
            st.top_logprobs = (
                {} if top_v is None or top_i is None
                else dict(zip(top_i[j][:n_top], top_v[j][:n_top]))
            )


def _by_rule(r: SampleRequest) -> bool:
    """Whether a drafted entry is verified by speculative sampling's rule: its guesses
    came from a draft model's distributions, and it samples without a seed."""
    return (r.draft_probs is not None and bool(r.draft_token_ids) and not r.params.greedy
            and r.params.seed is None)
