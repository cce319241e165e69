"""sentence-transformers' ``modules.json``: which folder holds a module of a given type.

An embedder's ``Pooling`` module (``pooling_config``) and a sparse encoder's
``SpladePooling`` (``splade_config``) are both found this way.
"""

from __future__ import annotations

import json
from pathlib import Path


def module_folder(path: str | Path, type_suffix: str) -> Path | None:
    """The folder of the first module whose ``type`` ends with ``type_suffix`` (such as
    ``".Pooling"``), if ``path``'s ``modules.json`` lists one; invalid JSON is a
    ``ValueError``."""
    modules = Path(path) / "modules.json"
    if not modules.is_file():
        return None
    try:
        listed = json.loads(modules.read_text())
    except ValueError as exc:
        raise ValueError(f"modules.json is not valid JSON: {exc}") from None
    for m in listed if isinstance(listed, list) else ():
        if isinstance(m, dict) and str(m.get("type", "")).endswith(type_suffix):
            return Path(path) / str(m.get("path", ""))
    return None
