"""Which layers share a block table: the KV cache groups of a hybrid model.

A model whose layers attend differently (Gemma 2 and 3: sliding-window layers
between full ones; Qwen2 with ``max_window_layers``) keeps one block table per
group of layers of one kind, so a sliding group can give its blocks back
behind the window while a full group keeps the whole context (vLLM's hybrid
KV cache manager does the same). Every group has the same number of layers,
``group_size``, so one block of the shared pool is the same number of bytes in
every group: block id ``b`` of group ``g`` lives in slot tensor ``s`` of the
layer that is ``g``'s ``s``-th, and the ``group_size`` slot tensors per rank
are the whole device pool. A kind with fewer layers than a multiple of
``group_size`` leaves its last group's spare slots unused.

Pure data, shared by the scheduler (one table per group and request) and the
worker (which layer reads which slot tensor through which table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    """``windows[g]`` is group ``g``'s sliding window (None: full attention) and
    ``layers[g]`` its layers in model order; group 0 is a full-attention one when the
    model has any."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        return max(len(g) for g in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def group_of(self, layer: int) -> int:
        for g, members in enumerate(self.layers):
            if layer in members:
                return g
        raise ValueError(f"layer {layer} is in no KV cache group")

    def local_slots(self, layers: Sequence[int]) -> list[int]:
        """The slot tensor of each of ``layers`` (a pipeline stage's, in order) on a
        rank that holds only those: each layer takes the next free slot of its group."""
        used = [0] * self.num_groups
        slots = []
        for layer in layers:
            g = self.group_of(layer)
            slots.append(used[g])
            used[g] += 1
        return slots


def plan_kv_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVGroupLayout:
    """Group layers by window into groups of ``min`` layers-per-kind each; with
    ``hybrid=False`` (or one kind) every layer is one group, which keeps every block of
    every layer (a model whose every layer slides releases them in that one group)."""
    if not layer_windows:  # (an attention-free model: one full group of no layers, so
        # the block tables that place prefix-cache snapshots are kept, and no KV)
        return KVGroupLayout((None,), ((),))
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        if w is not None and (not isinstance(w, int) or w <= 0):
            raise ValueError(f"layer {layer}: window must be None or a positive int, got {w!r}")
        kinds.setdefault(w, []).append(layer)
    if len(kinds) == 1 or not hybrid:
        window = layer_windows[0] if len(kinds) == 1 else None
        return KVGroupLayout((window,), (tuple(range(len(layer_windows))),))
    size = min(len(v) for v in kinds.values())
    windows: list[int | None] = []
    layers: list[tuple[int, ...]] = []
    # Full attention first, then the windows from the widest: group 0's table is the
    # one every request keeps whole.
    for w in sorted(kinds, key=lambda k: (k is not None, -(k or 0))):
        members = kinds[w]
        for i in range(0, len(members), size):
            windows.append(w)
            layers.append(tuple(members[i:i + size]))
    return KVGroupLayout(tuple(windows), tuple(layers))
