"""The adapters one engine replica has loaded, by id and by name.

An adapter is loaded on every tensor-parallel rank by the first request that
names it (or ``lora_modules`` at start). At most ``max_loaded`` stay loaded:
loading one more first unloads the least recently used adapter that no
unfinished request uses (its name stays known, so its next request loads it
again). An explicit removal is refused while requests still use the adapter,
so no step ever meets an adapter that is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pagedserve.cluster.executor import Executor
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.request import Request


class LoRARegistry:
    """``lora_int_id`` and ``lora_name`` each name one adapter; both are checked."""

    def __init__(self, executor: Executor, enabled: bool, max_loaded: int | None = None,
                 in_use: Callable[[int], int] = lambda lora_id: 0) -> None:
        """``in_use(id)`` counts the unfinished requests that run with adapter ``id``."""
        self.executor, self.enabled = executor, enabled
        self.max_loaded, self.in_use = max_loaded, in_use
        self._by_id: OrderedDict[int, LoRARequest] = OrderedDict()  # loaded, LRU first
        self._by_name: dict[str, LoRARequest] = {}  # loaded, or handed out by ``resolve``
        self._last_id = 0
        self.evictions = 0

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")

    def add(self, lora: LoRARequest) -> bool:
        """Load ``lora`` on every rank; False if it already is. ``ValueError`` when LoRA is
        off, the id or name is taken by another adapter, or a rank refuses the files."""
        self._check_enabled()
        known = self._by_id.get(lora.lora_int_id)
        if known is not None:
            if known != lora:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already used by adapter "
                                 f"{known.lora_name!r} ({known.lora_path})")
            self._by_id.move_to_end(lora.lora_int_id)
            return False
        other = self._by_name.get(lora.lora_name)
        if other is not None and other != lora:
            raise ValueError(f"lora_name {lora.lora_name!r} is already used by lora_int_id "
                             f"{other.lora_int_id} ({other.lora_path})")
        self._make_room()
        self.executor.add_lora(lora.lora_int_id, lora.lora_path)
        self._by_id[lora.lora_int_id] = lora
        self._by_name[lora.lora_name] = lora
        self._last_id = max(self._last_id, lora.lora_int_id)
        return True

    def resolve(self, name: str, path: str) -> LoRARequest:
        """The request for adapter ``name`` at ``path``: the loaded (or already resolved)
        one, else a new one with a fresh id, loaded by its first request. A name the
        ingress moved to another path (``/v1/load_lora_adapter`` with ``load_inplace``)
        drops its old adapter first; while requests still use that one, a
        ``ValueError``."""
        self._check_enabled()
        known = self._by_name.get(name)
        if known is not None:
            if known.lora_path == path:
                return known
            busy = self.in_use(known.lora_int_id)
            if busy:
                raise ValueError(f"LoRA adapter {name!r} is in use from "
                                 f"{known.lora_path!r} by {busy} unfinished requests; "
                                 f"retry for {path!r} when they finish")
            if known.lora_int_id in self._by_id:
                self.executor.remove_lora(known.lora_int_id)
                del self._by_id[known.lora_int_id]
            del self._by_name[name]
        self._last_id += 1
        lora = LoRARequest(name, self._last_id, path)
        self._by_name[name] = lora
        return lora

    def _make_room(self) -> None:
        """Unload idle adapters, least recently used first, until one more fits (if
        every loaded adapter is busy, the cap is exceeded until they finish)."""
        if self.max_loaded is None:
            return
        for lora_id in list(self._by_id):
            if len(self._by_id) < self.max_loaded:
                return
            if not self.in_use(lora_id):
                self.executor.remove_lora(lora_id)
                del self._by_id[lora_id]
                self.evictions += 1

    def remove(self, name: str | int) -> bool:
        """Unload adapter ``name`` (or the one whose ``lora_int_id`` it is, as vLLM's)
        and forget it; False if not loaded. A busy adapter (unfinished requests use it)
        is not removed: ``ValueError``."""
        lora = self._by_id.get(name) if isinstance(name, int) else self.get(name)
        if lora is None:
            return False
        name = lora.lora_name
        busy = self.in_use(lora.lora_int_id)
        if busy:
            raise ValueError(f"LoRA adapter {name!r} is in use by {busy} unfinished requests")
        self.executor.remove_lora(lora.lora_int_id)
        del self._by_id[lora.lora_int_id]
        del self._by_name[name]
        return True

    def get(self, name: str) -> LoRARequest | None:
        """The loaded adapter called ``name``, if any."""
        lora = self._by_name.get(name)
        return lora if lora is not None and lora.lora_int_id in self._by_id else None

    def contains(self, lora: LoRARequest) -> bool:
        return self._by_id.get(lora.lora_int_id) == lora

    def list(self) -> list[LoRARequest]:
        return sorted(self._by_id.values(), key=lambda r: r.lora_int_id)

    def stats(self, queues: Mapping[str, Iterable[Request]]) -> dict[str, Any]:
        """Loaded adapters, evictions, and per queue (running, waiting, ...) the
        sequences of each adapter, by name."""
        loaded = self.list()
        names = {r.lora_int_id: r.lora_name for r in self._by_name.values()}
        out: dict[str, Any] = {"loaded": [r.lora_name for r in loaded],
                               "num_loaded": len(loaded), "evictions": self.evictions}
        for state, queue in queues.items():
            counts: dict[str, int] = {}
            for r in queue:
                if r.lora_id:
                    name = names.get(r.lora_id, str(r.lora_id))
                    counts[name] = counts.get(name, 0) + 1
            out[state] = counts
        return out
