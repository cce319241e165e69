"""Suffix decoding's two searches against the definition: a suffix tree over many
responses and the scan of one request's own tokens must both return the draft a
brute-force count over every depth-limited string gives, token for token."""

from __future__ import annotations

import random
from array import array

import pytest

from pagedserve.scheduler.suffix_decoding import ResponseCache, speculate_local
from pagedserve.scheduler.suffix_tree import SuffixTree, _Node, max_draft_len


def brute_force(seqs: list[list[int]], context: list[int], depth: int, k: int,
                factor: float, min_prob: float) -> tuple[list[int], float, int]:
    """Count every string ``seq[p : p + depth]`` (sequences added one after another);
    follow the most frequent continuation (ties: the one spelled first) from each
    match length; keep the best sum of estimates, the longer match on equal sums."""
    strings = [(q, p, s[p:p + depth]) for q, s in enumerate(seqs) for p in range(len(s))]

    def after(path: list[int]) -> dict[int, tuple[int, tuple[int, int]]]:
        out: dict[int, tuple[int, tuple[int, int]]] = {}
        for q, p, s in strings:
            if len(s) > len(path) and s[:len(path)] == path:
                t = s[len(path)]
                c, first = out.get(t, (0, (q, p + len(path))))
                out[t] = (c + 1, min(first, (q, p + len(path))))
        return out

    def count(path: list[int]) -> int:
        return sum(1 for _, _, s in strings if s[:len(path)] == path and len(s) >= len(path))

    ctx = context[-depth:]
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for m in range(1, len(ctx)):
        path = ctx[-m:]
        if count(path) == 0:
            break
        cap = min(max_draft_len(m, k, factor), depth - m)
        toks: list[int] = []
        prob, score = 1.0, 0.0
        while len(toks) < cap:
            nxt = after(path)
            if not nxt:
                break
            t = min(nxt, key=lambda t: (-nxt[t][0], nxt[t][1]))
            prob *= nxt[t][0] / count(path)
            if prob < min_prob:
                break
            toks.append(t)
            score += prob
            path = [*path, t]
        if score >= best[1] and score > 0:
            best = (toks, score, m)
    return best


def check_integrity(tree: SuffixTree) -> None:
    """Every node's count is the strings ending at it plus its children's, its
    children are keyed by their first token, and nodes with one child and no
    string ending there were merged."""
    stack: list[_Node] = [tree.root]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        kids = node.children or {}
        assert sum(c.count for c in kids.values()) <= node.count
        for tok, child in kids.items():
            assert child.parent is node
            assert child.length >= 1 and child.count >= 1
            assert child.seq[child.start] == tok
            assert child.start + child.length <= len(child.seq)
            assert child.count < node.count or node is tree.root
            stack.append(child)
    assert seen == tree.num_nodes


ALPHABETS = [[1, 2], [1, 2, 3], [0, 1, 256, 65536, 257]]


@pytest.mark.parametrize("seed", range(6))
def test_tree_equals_the_definition_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        depth = rng.randint(2, 9)
        alphabet = rng.choice(ALPHABETS)
        seqs = [[rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
                for _ in range(rng.randint(1, 4))]
        tree = SuffixTree(depth)
        for q, s in enumerate(seqs):
            # Added in pieces, as a response grows between steps.
            i = 0
            while i < len(s):
                j = i + rng.randint(1, 5)
                tree.extend(q, s[i:j])
                i = j
        check_integrity(tree)
        assert tree.root.count == sum(len(s) for s in seqs)
        for _ in range(6):
            context = [rng.choice(alphabet) for _ in range(rng.randint(1, 12))]
            k, factor = rng.randint(1, 8), rng.choice([0.5, 1.0, 2.0])
            min_prob = rng.choice([0.0, 0.1, 0.4])
            want = brute_force(seqs, context, depth, k, factor, min_prob)
            got = tree.speculate(context, k, factor, min_prob)
            assert (got.token_ids, got.match_len) == (want[0], want[2]), (seqs, context)
            assert got.score == pytest.approx(want[1])


@pytest.mark.parametrize("seed", range(6))
def test_own_token_search_equals_the_definition(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(60):
        depth = rng.randint(2, 10)
        tokens = [rng.choice(rng.choice(ALPHABETS)) for _ in range(rng.randint(1, 40))]
        hay = array("i", tokens).tobytes()
        k, factor = rng.randint(1, 8), rng.choice([0.5, 1.0, 2.0])
        min_prob = rng.choice([0.0, 0.1, 0.4])
        want = brute_force([tokens], tokens, depth, k, factor, min_prob)
        got = speculate_local(hay, tokens, depth, k, factor, min_prob)
        assert (got.token_ids, got.match_len) == (want[0], want[2]), tokens
        assert got.score == pytest.approx(want[1])
        # Told another source scored s, it still finds its best when that reaches s.
        bar = rng.choice([0.0, 0.5, 1.0, 2.0, 3.5])
        floored = speculate_local(hay, tokens, depth, k, factor, min_prob, at_least=bar)
        if want[1] >= bar:
            assert floored.token_ids == want[0]
        else:
            assert floored.score < bar


def test_frequencies_decide_the_continuation_and_its_length() -> None:
    # After "5 6": 7 8 9 three times, 7 1 once. The path goes 7 (4/4) then 8 (3/4);
    # at min_token_prob 0.8 it stops before 8.
    tree = SuffixTree(8)
    for q, resp in enumerate([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 7, 8, 9]]):
        tree.extend(q, resp)
    got = tree.speculate([3, 5, 6], 10, 1.0, 0.1)
    assert got.token_ids == [7, 8] and got.probs == [1.0, 0.75] and got.match_len == 2
    assert tree.speculate([3, 5, 6], 10, 2.0, 0.1).token_ids == [7, 8, 9]
    assert tree.speculate([3, 5, 6], 10, 2.0, 0.8).token_ids == [7]
    assert tree.speculate([4, 4], 10, 2.0, 0.1).token_ids == []  # no match at all


def test_a_depth_one_tree_and_empty_contexts_propose_nothing() -> None:
    tree = SuffixTree(1)
    tree.extend(0, [1, 2, 1, 2])
    assert tree.speculate([1], 4, 1.0, 0.1).token_ids == []
    assert tree.speculate([], 4, 1.0, 0.1).token_ids == []
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)


def test_the_response_cache_drops_its_older_half() -> None:
    cache = ResponseCache(max_depth=4, max_requests=4)
    slots = [cache.open() for _ in range(5)]
    assert all(s is not None for s in slots)
    first_tree = slots[0][0]  # type: ignore[index]
    assert first_tree is slots[1][0] and not cache.holds(first_tree)  # type: ignore[index]
    assert cache.num_requests == 3 and len(cache.trees) == 2
    for limit in (1, 2, 5, 7):
        odd = ResponseCache(max_depth=4, max_requests=limit)
        held = []
        for _ in range(3 * limit):
            odd.open()
            held.append(odd.num_requests)
        assert max(held) == max(1, limit - limit % 2)  # never over the limit
        assert min(held[limit:]) >= max(1, limit // 2)
    off = ResponseCache(max_depth=4, max_requests=0)
    assert off.open() is None and off.trees == []
