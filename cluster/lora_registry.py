"""The adapters one engine replica has loaded, by id and by name.

An adapter is loaded on every tensor-parallel rank once (the first request
that names it, or ``--lora-modules`` at start), and stays until removed;
a removal is refused while requests still run with it, so no step ever
meets an adapter that is gone.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.cluster.executor import Executor
from pagedserve.scheduler.lora_request import LoRARequest


class LoRARegistry:
    """``lora_int_id`` and ``lora_name`` each name one adapter; both are checked."""

    def __init__(self, executor: Executor, enabled: bool) -> None:
        self.executor, self.enabled = executor, enabled
        self._by_id: dict[int, LoRARequest] = {}

    def add(self, lora: LoRARequest) -> bool:
        """Load ``lora`` on every rank; False if it already is. ``ValueError`` when LoRA is
        off, the id or name is taken by another adapter, or a rank refuses the files."""
        if not self.enabled:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        known = self._by_id.get(lora.lora_int_id)
        if known is not None:
            if known != lora:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already used by adapter "
                                 f"{known.lora_name!r} ({known.lora_path})")
            return False
        other = self.get(lora.lora_name)
        if other is not None:
            raise ValueError(f"lora_name {lora.lora_name!r} is already loaded with "
                             f"lora_int_id {other.lora_int_id}")
        self.executor.add_lora(lora.lora_int_id, lora.lora_path)
        self._by_id[lora.lora_int_id] = lora
        return True

    def remove(self, name: str, in_use: Callable[[int], int]) -> bool:
        """Unload adapter ``name``; False if unknown. ``in_use(id)`` counts the unfinished
        requests running with it: a busy adapter is not removed (``ValueError``)."""
        lora = self.get(name)
        if lora is None:
            return False
        busy = in_use(lora.lora_int_id)
        if busy:
            raise ValueError(f"LoRA adapter {name!r} is in use by {busy} unfinished requests")
        self.executor.remove_lora(lora.lora_int_id)
        del self._by_id[lora.lora_int_id]
        return True

    def get(self, name: str) -> LoRARequest | None:
        return next((r for r in self._by_id.values() if r.lora_name == name), None)

    def contains(self, lora: LoRARequest) -> bool:
        return self._by_id.get(lora.lora_int_id) == lora

    def list(self) -> list[LoRARequest]:
        return sorted(self._by_id.values(), key=lambda r: r.lora_int_id)

    def next_id(self) -> int:
        """A free ``lora_int_id`` for an adapter loaded by name only (the HTTP API)."""
        return max(self._by_id, default=0) + 1
