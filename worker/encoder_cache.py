"""Image encoder outputs kept across steps and requests, by the picture's content key.

A picture is encoded whole (thousands of patch rows through the vision tower) even
when a step computes only some of its rows: a prefix-cache hit that stops inside
the image, or a chunk boundary, needs the rest later. And the same picture often
comes back in another request whose text before it differs, so the prefix cache
misses while the encoder output is the same. The runner keeps the latest outputs
here, least recently used first out, up to ``max_rows`` embedding rows (vLLM's
encoder cache budget, in rows of the model's hidden size). A cached output is the
very tensor the encoder made, so tokens and logprobs do not depend on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

# About 16 of Gemma 3's 256-token images; 40 MB at hidden size 2,560 in bf16.
DEFAULT_MAX_ROWS = 4096


class EncoderCache:
    """Least-recently-used encoder outputs, at most ``max_rows`` rows in all."""

    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.max_rows = max_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output for ``key``, from the cache or from ``encode()`` (then kept: the
        least recently used go until it fits, or until it is the only one left; a
        budget of 0 keeps nothing)."""
        out = self._entries.get(key)
        if out is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return out
        self.misses += 1
        out = encode()
        n = out.shape[0]
        if self.max_rows > 0:
            # Past the budget alone, an output is still kept, by itself: a causal image's
            # later chunks need it in the next steps (``scheduler.multimodal``).
            while self._entries and self.rows + n > self.max_rows:
                _, old = self._entries.popitem(last=False)
                self.rows -= old.shape[0]
            self._entries[key] = out
            self.rows += n
        return out
