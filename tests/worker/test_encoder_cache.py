"""The image encoder cache: least recently used out first, within its row budget; an
output larger than the budget is computed and not kept."""

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
    cache.get("big", enc("big", 11))  # never fits: computed, not kept
    assert "big" in made and len(cache) == 2 and cache.rows == 8
    assert (cache.hits, cache.misses) == (2, 5)
