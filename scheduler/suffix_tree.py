"""A depth-limited suffix tree with frequency counts: suffix decoding's index of
past responses (``suffix_decoding``).

Each sequence added contributes, for every position ``p``, the string
``seq[p : p + max_depth]``, grown one token at a time as the sequence is
extended. A node's ``count`` is how many of those strings pass through it, so
the path from a matched context follows the continuations seen most often and
``child.count / node.count`` estimates the chance of each step. Edges are
compressed (a node holds a run of tokens, read from the sequence that last
spelled it), so the tree has O(tokens) nodes, not O(tokens x depth).

Appending a token touches at most ``max_depth`` nodes: each of the sequence's
growing strings (one per recent start, oldest first) steps down by the token,
extending a leaf, entering or splitting a child, or growing a node whose only
string is the one that moves. The tree only grows: eviction drops whole trees
(``suffix_decoding.ResponseCache``), so edges may read any sequence ever
added to it. Pure Python, like the rest of the scheduler.

Learnt from the SuffixDecoding paper (Oliaro et al., 2024) and Arctic
Inference's suffix cache, which vLLM's ``method="suffix"`` calls.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Draft:
    """Guessed tokens with their estimated probabilities; ``score`` is their sum
    (the expected number accepted, were the estimates right)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def max_draft_len(match_len: int, max_spec_tokens: int, max_spec_factor: float) -> int:
    """How many tokens a match of ``match_len`` may propose: a short match is weak
    evidence, so it may only guess ``max_spec_factor`` times its own length."""
    return max(0, min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6)))


class _Node:
    """A run of tokens ``seq[start : start + length]`` after its parent's."""

    __slots__ = ("children", "count", "length", "parent", "seq", "start")

    def __init__(self, parent: _Node | None, seq: array, start: int, length: int,
                 count: int) -> None:
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.count = count
        self.seq = seq
        self.start = start
        self.length = length

    def child(self, token: int) -> _Node | None:
        return self.children.get(token) if self.children else None

    def add_child(self, token: int, node: _Node) -> None:
        if self.children is None:
            self.children = {}
        self.children[token] = node


class SuffixTree:
    """Depth-limited suffix tree over many sequences (see the module docstring)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(None, array("i"), 0, 0, 0)
        self.num_nodes = 1
        self.num_tokens = 0
        self._seqs: dict[int, array] = {}
        # Where each sequence's growing strings end (a node's end), oldest first.
        self._ends: dict[int, deque[_Node]] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created on first use)."""
        seq = self._seqs.setdefault(seq_id, array("i"))
        ends = self._ends.setdefault(seq_id, deque())
        for token in tokens:
            self._append(seq, ends, int(token))
        self.num_tokens += len(tokens)

    def _append(self, seq: array, ends: deque[_Node], token: int) -> None:
        root = self.root
        ends.append(root)  # the string that starts at this token
        root.count += 1
        if len(ends) > self.max_depth:
            ends.popleft()  # that string is max_depth long: complete
        pos = len(seq)
        seq.append(token)
        for i in range(len(ends)):
            node = ends[i]
            kids = node.children
            child = kids.get(token) if kids else None
            if child is None:
                if node is not root and node.count == 1:
                    # Only this string reaches the node: a leaf, extended in place.
                    node.length += 1
                    node.seq, node.start = seq, pos + 1 - node.length
                    continue
                leaf = _Node(node, seq, pos, 1, 1)
                node.add_child(token, leaf)
                self.num_nodes += 1
                ends[i] = leaf
            elif node is not root and node.count == child.count + 1:
                # This string is the only one ending at the node and every other one
                # goes on into ``child``: the node absorbs the child's first token.
                if child.length == 1:
                    parent = node.parent
                    assert parent is not None
                    child.count += 1
                    child.length = node.length + 1
                    child.seq, child.start = seq, pos + 1 - child.length
                    child.parent = parent
                    parent.children[seq[child.start]] = child  # type: ignore[index]
                    self.num_nodes -= 1
                    ends[i] = child
                else:
                    node.length += 1
                    node.seq, node.start = seq, pos + 1 - node.length
                    del node.children[token]  # type: ignore[union-attr]
                    child.start += 1
                    child.length -= 1
                    node.children[child.seq[child.start]] = child  # type: ignore[index]
            elif child.length == 1:
                child.count += 1
                child.seq, child.start = seq, pos
                ends[i] = child
            else:
                # Split the child after its first token; the string ends at the split.
                mid = _Node(node, seq, pos, 1, child.count + 1)
                child.start += 1
                child.length -= 1
                child.parent = mid
                mid.add_child(child.seq[child.start], child)
                node.children[token] = mid  # type: ignore[index]
                self.num_nodes += 1
                ends[i] = mid

    def match(self, context: array) -> tuple[_Node, int] | None:
        """Where ``context`` (C ints) ends in the tree (a node and how far into its
        run), or None when no string starts with it. Runs are compared whole."""
        node, idx = self.root, 0
        i, n = 0, len(context)
        while i < n:
            if idx == node.length:
                nxt = node.child(context[i])
                if nxt is None:
                    return None
                node, idx = nxt, 0
            take = min(node.length - idx, n - i)
            at = node.start + idx
            if node.seq[at:at + take] != context[i:i + take]:
                return None
            i += take
            idx += take
        return node, idx

    def continue_path(self, node: _Node, idx: int, max_tokens: int,
                      min_token_prob: float) -> Draft:
        """Follow the most frequent continuation from a match while each token's
        estimated probability stays at least ``min_token_prob``. Ties go to the
        child seen first."""
        draft = Draft()
        prob = 1.0
        while len(draft.token_ids) < max_tokens:
            if idx == node.length:
                best = None
                for child in (node.children or {}).values():
                    if best is None or child.count > best.count:
                        best = child
                if best is None:
                    break
                prob *= best.count / node.count
                if prob < min_token_prob:
                    break
                node, idx = best, 0
            draft.token_ids.append(node.seq[node.start + idx])
            draft.probs.append(prob)
            draft.score += prob
            idx += 1
        return draft

    def speculate(self, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float, min_token_prob: float) -> Draft:
        """The best-scoring draft over every match length ``1 .. len(context) - 1``
        (``context``: the sequence's last ``max_depth`` tokens at most); on equal
        scores the longer match wins. The lengths whose pattern is followed by some
        token form a prefix of that range (where a pattern goes on, so does its
        suffix), so the longest is found by bisection (a running response matches
        itself up to its end, with nothing after), and shorter ones are skipped once
        no draft they allow could beat the best so far."""
        context = array("i", context[-self.max_depth:])
        lo, hi = 0, len(context) - 1  # lo: a length known to go on (0 does, or nothing)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self.match(context[-mid:])
            if found is not None and (found[1] < found[0].length or found[0].children):
                lo = mid
            else:
                hi = mid - 1
        best = Draft()
        for m in range(lo, 0, -1):
            cap = min(max_draft_len(m, max_spec_tokens, max_spec_factor), self.max_depth - m)
            if cap <= best.score:
                continue
            found = self.match(context[-m:])
            assert found is not None
            draft = self.continue_path(found[0], found[1], cap, min_token_prob)
            if draft.score > best.score:
                draft.match_len = m
                best = draft
        return best
