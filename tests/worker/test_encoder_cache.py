"""The image encoder cache: least recently used out first, within its row budget; an
output larger than the budget is kept alone (a causal image's later chunks need it);
a budget of 0 keeps nothing."""

from __future__ import annotations

import torch

from pagedserve.worker.encoder_cache import EncoderCache


def test_lru_within_the_row_budget() -> None:
    made: list[str] = []

    def enc(key: str, rows: int):
        def run() -> torch.Tensor:
            made.append(key)
            return torch.full((rows, 2), float(len(made)))
        return run

    cache = EncoderCache(max_rows=10)
    a = cache.get("a", enc("a", 4))
    cache.get("b", enc("b", 4))
    assert cache.get("a", enc("a", 4)) is a  # a hit, and now the most recent
    cache.get("c", enc("c", 4))  # 12 rows > 10: b (least recently used) goes
    assert (len(cache), cache.rows) == (2, 8)
    cache.get("a", enc("a", 4))
    cache.get("b", enc("b", 4))  # recomputed; c goes
    assert made == ["a", "b", "c", "b"]
    big = cache.get("big", enc("big", 11))  # past the budget: kept alone
    assert "big" in made and len(cache) == 1 and cache.rows == 11
    assert cache.get("big", enc("big", 11)) is big
    cache.get("a", enc("a", 4))  # the next output pushes it out
    assert (len(cache), cache.rows) == (1, 4)
    assert (cache.hits, cache.misses) == (3, 6)
    none = EncoderCache(max_rows=0)
    none.get("a", enc("a", 4))
    assert len(none) == 0 and none.rows == 0
