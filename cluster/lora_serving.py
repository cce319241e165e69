"""Which OpenAI ``model`` names are LoRA adapters, for the HTTP ingress, and the routes
that list the names (``/v1/models``) and add adapters at run time.

Three sources, as in vLLM and Ray Serve LLM: ``lora_modules`` (name -> PEFT
directory, loaded on every replica at start), ``lora_dir`` (Ray Serve LLM's
dynamic loading path): ``model: "NAME"`` with ``LORA_DIR/NAME/`` holding an
adapter is loaded by the first replica a request for it reaches, so adapters can
be added to a running cluster by copying a directory; and, with
``allow_runtime_lora_updating``, vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, which name a directory at run time (an RL loop
publishing each new adapter under a new name). A replica loads a named adapter
on its first request, keyed by name and path, so a name given a new path is a
new adapter to it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.responses import now
from pagedserve.scheduler.lora_request import lora_cache_key

router = APIRouter()

# An adapter name is one path component: no separators, no "..", nothing hidden.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


class AdapterCatalog:
    """Adapter name -> (name, path), from the static modules first, then ``lora_dir``."""

    def __init__(self, modules: Mapping[str, str] | None, lora_dir: str | None,
                 base_names: tuple[str, ...]) -> None:
        self.modules = dict(modules or {})
        self.runtime: dict[str, str] = {}  # loaded through the API
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
        return bool(self.modules) or bool(self.runtime) or self.lora_dir is not None

    def lookup(self, name: str) -> tuple[str, str] | None:
        """``(name, path)`` when ``name`` is an adapter; None when it is not one."""
        if name in self.modules:
            return name, self.modules[name]
        if name in self.runtime:
            return name, self.runtime[name]
        if self.lora_dir is not None and name not in self.base_names and _NAME_RE.match(name):
            path = self.lora_dir / name
            if _is_adapter_dir(path):
                return name, str(path)
        return None

    def available(self) -> list[tuple[str, str]]:
        """Every adapter a request may name now (the static ones, then ``lora_dir``'s)."""
        found = {**self.modules, **self.runtime}
        if self.lora_dir is not None:
            for path in sorted(self.lora_dir.iterdir()):
                hit = None if path.name in found else self.lookup(path.name)
                if hit is not None:
                    found[path.name] = hit[1]
        return list(found.items())

    def register(self, name: str, path: str, replace: bool = False) -> None:
        """Serve ``path`` as ``name`` from now on (a 400 naming the field otherwise)."""
        if not _NAME_RE.match(name) or name in self.base_names:
            raise APIError(f"{name!r} is not a usable adapter name (letters, digits, '.', "
                           "'_', '-'; not the base model's name)", param="lora_name")
        if not Path(path).is_absolute() or not _is_adapter_dir(Path(path)):
            raise APIError(f"lora_path {path!r} is not an absolute path to a directory with "
                           "an adapter_config.json", param="lora_path")
        if name in self.modules or (name in self.runtime and not replace):
            raise APIError(f"the adapter {name!r} is already loaded (load_inplace: true "
                           "replaces a runtime one)", param="lora_name")
        if self.runtime.get(name) == path:
            raise APIError(f"the adapter {name!r} is served from {path!r} already: new "
                           "weights go in a new directory", param="lora_path")
        self.runtime[name] = path

    def unregister(self, name: str) -> None:
        if name not in self.runtime:
            raise APIError(f"no adapter {name!r} was loaded at run time", status=404,
                           param="lora_name", code="model_not_found")
        del self.runtime[name]


class LoadLoRARequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1)


class LoRAEndpoints:
    """Mixed into ``OpenAIServer``, which provides ``_authorize``, ``adapters`` and
    ``lora_updates`` (``allow_runtime_lora_updating``)."""

    def _check_updates(self, raw: Request) -> None:
        self._authorize(raw)
        if not self.lora_updates:
            raise APIError("runtime LoRA updating is off: start the server with "
                           "--allow-runtime-lora-updating", param="lora_name")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoRARequest, raw: Request) -> dict[str, Any]:
        """Serve a PEFT directory under a name (replicas load it on first use)."""
        self._check_updates(raw)
        self.adapters.register(body.lora_name, body.lora_path, body.load_inplace)
        return {"success": True, "lora_name": body.lora_name, "lora_path": body.lora_path}

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoRARequest,
                                  raw: Request) -> dict[str, Any]:
        """Stop serving a name loaded at run time (replicas unload it when idle, least
        recently used first, as ever)."""
        self._check_updates(raw)
        self.adapters.unregister(body.lora_name)
        return {"success": True, "lora_name": body.lora_name}


models_router = APIRouter()


class ModelEndpoints:
    """``GET /v1/models`` and ``/v1/models/{model}``: the served names and the adapters.
    Mixed into ``OpenAIServer``, which provides ``_authorize``, ``_check_model``,
    ``_engine_info``, the names and ``adapters``."""

    @models_router.get("/v1/models")
    async def models(self, raw: Request) -> dict[str, Any]:
        self._authorize(raw)
        base = await self._model_card()
        aliases = [{**base, "id": name} for name in self.aliases]
        adapters = [{**base, "id": name, "root": path, "parent": self.served_name}
                    for name, path in self.adapters.available()]
        return {"object": "list", "data": [base, *aliases, *adapters]}

    @models_router.get("/v1/models/{model:path}")
    async def model(self, model: str, raw: Request) -> dict[str, Any]:
        """OpenAI's model retrieval: the base model or an adapter, by any name the
        other routes take; a 404 ``model_not_found`` otherwise."""
        self._authorize(raw)
        lora = self._check_model(model)
        base = await self._model_card()
        if lora is None:
            return {**base, "id": model}
        return {**base, "id": model, "root": lora[1], "parent": self.served_name}

    async def _model_card(self) -> dict[str, Any]:
        info = await self._engine_info()
        return {"id": self.served_name, "object": "model", "created": now(),
                "owned_by": "pagedserve", "root": self.model_id, "parent": None,
                "max_model_len": info["max_model_len"]}


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
