"""Which OpenAI ``model`` names are LoRA adapters, for the HTTP ingress.

Two sources, as in vLLM and Ray Serve LLM: ``lora_modules`` (name -> PEFT
directory, loaded on every replica at start) and ``lora_dir`` (Ray Serve
LLM's dynamic loading path): ``model: "NAME"`` with ``LORA_DIR/NAME/`` holding
an adapter is loaded by the first replica a request for it reaches, so
adapters can be added to a running cluster by copying a directory.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from pagedserve.scheduler.lora_request import lora_cache_key

# An adapter name is one path component: no separators, no "..", nothing hidden.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


class AdapterCatalog:
    """Adapter name -> (name, path), from the static modules first, then ``lora_dir``."""

    def __init__(self, modules: Mapping[str, str] | None, lora_dir: str | None,
                 base_names: tuple[str, ...]) -> None:
        self.modules = dict(modules or {})
        self.lora_dir = Path(lora_dir) if lora_dir else None
        self.base_names = base_names
        for name, path in self.modules.items():
            if not _NAME_RE.match(name) or name in base_names:
                raise ValueError(f"lora_modules: {name!r} is not a usable adapter name "
                                 "(letters, digits, '.', '_', '-'; not the base model's name)")
            if not _is_adapter_dir(Path(path)):
                raise ValueError(f"lora_modules: {name}={path} has no adapter_config.json")
        if self.lora_dir is not None and not self.lora_dir.is_dir():
            raise ValueError(f"lora_dir {lora_dir!r} is not a directory")

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or self.lora_dir is not None

    def lookup(self, name: str) -> tuple[str, str] | None:
        """``(name, path)`` when ``name`` is an adapter; None when it is not one."""
        if name in self.modules:
            return name, self.modules[name]
        if self.lora_dir is not None and name not in self.base_names and _NAME_RE.match(name):
            path = self.lora_dir / name
            if _is_adapter_dir(path):
                return name, str(path)
        return None

    def available(self) -> list[tuple[str, str]]:
        """Every adapter a request may name now (the static ones, then ``lora_dir``'s)."""
        found = dict(self.modules)
        if self.lora_dir is not None:
            for path in sorted(self.lora_dir.iterdir()):
                hit = None if path.name in found else self.lookup(path.name)
                if hit is not None:
                    found[path.name] = hit[1]
        return list(found.items())


def adapter_affinity_key(name: str, path: str) -> bytes:
    """A routing key every request for the adapter carries ahead of its block hashes.

    The prefix-affinity router then sends an adapter's requests, even prompts too short
    for a full block, to the replica that served it last (unless that one is busier by
    more than the imbalance threshold), as Ray Serve LLM's multiplexing does: the other
    replicas do not load the adapter at all.
    """
    return hashlib.blake2b(f"adapter|{lora_cache_key(name, path)}".encode(),
                           digest_size=16).digest()


def parse_lora_modules(items: list[str] | Mapping[str, str] | None) -> dict[str, str]:
    """vLLM's ``--lora-modules name=path ...`` (or a mapping) -> ``{name: path}``."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        return dict(items)
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
        if name in out:
            raise ValueError(f"lora_modules: {name!r} is given twice")
        out[name] = path
    return out
