"""Suffix decoding (vLLM's ``speculative_config={"method": "suffix"}``; SuffixDecoding,
Oliaro et al., 2024): model-free guesses from the request's own tokens and from
the responses of earlier requests.

Where n-gram lookup proposes whatever followed the latest match of the last few
tokens, suffix decoding weighs every match: for each match length ``m`` (up to
``max_tree_depth - 1``) it follows the continuation seen most often after the
last ``m`` tokens, multiplying ``count(child) / count(node)`` as it goes, and
stops where that estimate falls under ``min_token_prob`` or after
``max_spec_factor * m`` tokens (a short match is weak evidence). The draft whose
estimates sum highest wins, so a row guesses many tokens where the past agrees
and none where it does not. Agentic loops, repeated tool calls, templated
answers and code edits repeat earlier responses: those rows advance tens of
tokens a step.

Two sources, as in the paper:

- the request's own prompt and output, searched in place (``Request.token_buffer``
  and ``bytes.rfind``): no index to build, so a long prompt costs nothing up front
  (a pattern is counted over its latest ``MAX_OCCURRENCES`` occurrences at most);
- earlier and running responses (not prompts) in depth-limited suffix trees
  (``suffix_tree``), at most ``max_cached_requests`` of them: responses go into
  the newer of two trees, and when it holds half the limit (rounded down) the
  older tree is dropped whole (the cache keeps between half the limit and the
  limit, oldest half evicted first; vLLM evicts one response at a time).

The own-token search reads the same counts a suffix tree over the request's tokens
would hold (each position's string limited to ``max_tree_depth`` tokens, the
current one ending at the end), so both sources follow one rule and one test
oracle. Pure Python, on the scheduler like the n-gram search.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from pagedserve.scheduler.request import TOKEN_WIDTH, Request
from pagedserve.scheduler.suffix_tree import Draft, SuffixTree, max_draft_len

# A pattern seen more often than this in a request's own tokens is counted over its
# latest occurrences only: the estimate is as good, its cost bounded on long prompts.
MAX_OCCURRENCES = 128


def speculate_local(hay: bytes | bytearray, tokens: Sequence[int], max_depth: int,
                    max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                    max_occurrences: int = MAX_OCCURRENCES, at_least: float = 0.0) -> Draft:
    """The best draft from one sequence's own tokens (``hay``: them as C ints; the
    continuation is read from ``tokens``), by the rule of ``SuffixTree.speculate``,
    counting each match's latest ``max_occurrences`` occurrences at most. Match
    lengths whose drafts could not score ``at_least`` (another source's best) are
    skipped unsearched."""
    n = len(hay) // TOKEN_WIDTH
    best = Draft()
    end = (n - 1) * TOKEN_WIDTH  # earlier occurrences lie in all but the last token
    # The lengths whose pattern occurred before form a prefix of 1 .. depth - 1 (a
    # pattern's suffix occurs wherever it does): bisect for the longest.
    lo, hi = 0, min(max_depth, n) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _latest(hay, hay[(n - mid) * TOKEN_WIDTH:], end) >= 0:
            lo = mid
        else:
            hi = mid - 1
    for m in range(lo, 0, -1):
        cap = min(max_draft_len(m, max_spec_tokens, max_spec_factor), max_depth - m)
        if cap <= best.score or cap < at_least:
            continue
        needle = hay[(n - m) * TOKEN_WIDTH:]
        ends = []
        at = _latest(hay, needle, end)
        while at >= 0 and len(ends) < max_occurrences:
            ends.append(at // TOKEN_WIDTH + m)
            at = _latest(hay, needle, at + len(needle) - TOKEN_WIDTH)
        if not ends:
            continue
        ends.reverse()
        ends.append(n)  # the current occurrence, which nothing follows yet
        draft = _follow(tokens, n, ends, cap, min_token_prob)
        if draft.score > best.score:
            draft.match_len = m
            best = draft
    return best


def _latest(hay: bytes | bytearray, needle: bytes | bytearray, end: int) -> int:
    """Byte offset of the latest token-aligned occurrence of ``needle`` ending by
    ``end``, or -1."""
    at = hay.rfind(needle, 0, end)
    while at >= 0 and at % TOKEN_WIDTH:
        at = hay.rfind(needle, 0, at + len(needle) - 1)
    return at


def _follow(tokens: Sequence[int], n: int, ends: list[int], max_tokens: int,
            min_token_prob: float) -> Draft:
    """The most frequent continuation after the occurrences ending at ``ends``
    (ascending; ties go to the token that occurs first, as the tree's first child)."""
    draft = Draft()
    prob = 1.0
    for j in range(max_tokens):
        counts = Counter([tokens[e + j] for e in ends if e + j < n])
        if not counts:
            break
        token, count = max(counts.items(), key=itemgetter(1))
        prob *= count / len(ends)
        if prob < min_token_prob:
            break
        draft.token_ids.append(token)
        draft.probs.append(prob)
        draft.score += prob
        if count < len(ends):
            ends = [e for e in ends if e + j < n and tokens[e + j] == token]
    return draft


class ResponseCache:
    """Responses of recent requests in at most two suffix trees (older first)."""

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.max_depth = max_depth
        self.max_requests = max_requests
        # Two trees of half the limit each (one of one response for a limit of one).
        self.per_tree = max(1, max_requests // 2)
        self.max_trees = 1 if max_requests == 1 else 2
        self.trees: list[SuffixTree] = []
        self._next_id = 0

    def open(self) -> tuple[SuffixTree, int] | None:
        """A slot for a new response, in the newer tree (None: the cache is off)."""
        if self.max_requests <= 0:
            return None
        if not self.trees or self.trees[-1].num_seqs >= self.per_tree:
            self.trees.append(SuffixTree(self.max_depth))
            if len(self.trees) > self.max_trees:
                self.trees.pop(0)
        tree = self.trees[-1]
        seq_id = self._next_id
        self._next_id += 1
        tree.extend(seq_id, ())
        return tree, seq_id

    def holds(self, tree: SuffixTree) -> bool:
        return any(t is tree for t in self.trees)

    @property
    def num_requests(self) -> int:
        return sum(t.num_seqs for t in self.trees)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trees)


@dataclass(slots=True)
class _Response:
    """Where a running request's response goes, and how much of it is there."""

    tree: SuffixTree | None
    seq_id: int
    added: int = 0


class SuffixProposer:
    """The scheduler's suffix decoding: per-request bookkeeping around the cache."""

    def __init__(self, max_depth: int, max_cached_requests: int, num_speculative_tokens: int,
                 max_spec_factor: float, min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.k = num_speculative_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = ResponseCache(max_depth, max_cached_requests)
        self._running: dict[str, _Response] = {}

    def propose(self, req: Request, max_tokens: int) -> tuple[int, ...]:
        """Up to ``min(k, max_tokens)`` guesses for a decode row (possibly none)."""
        self._add_response(req)
        k = min(self.k, max_tokens)
        if k <= 0:
            return ()
        args = (k, self.max_spec_factor, self.min_token_prob)
        # The cache first (cheap), so the own-token search may skip match lengths
        # that cannot beat it; on equal scores the own tokens' draft wins (vLLM's).
        cached = Draft()
        context = req.all_token_ids[-self.max_depth:]
        for tree in reversed(self.cache.trees):
            draft = tree.speculate(context, *args)
            if draft.score > cached.score:
                cached = draft
        own = speculate_local(req.token_buffer(), req.all_token_ids, self.max_depth, *args,
                              at_least=cached.score)
        best = own if own.token_ids and own.score >= cached.score else cached
        return tuple(best.token_ids)

    def release(self, req: Request) -> None:
        """The request ended: its whole response stays cached for later requests (a
        beam's tokens are its group's choice, so beams are left out)."""
        if req.beam is None and (req.request_id in self._running or req.num_output_tokens):
            self._add_response(req)
        self._running.pop(req.request_id, None)

    def _add_response(self, req: Request) -> None:
        resp = self._running.get(req.request_id)
        if resp is None:
            slot = self.cache.open()
            resp = self._running[req.request_id] = (
                _Response(None, -1) if slot is None else _Response(*slot))
        if resp.tree is None:
            return
        if not self.cache.holds(resp.tree):  # evicted while it ran
            resp.tree = None
            return
        new = req.all_token_ids[req.num_prompt_tokens + resp.added:]
        if new:
            resp.tree.extend(resp.seq_id, new)
            resp.added += len(new)
