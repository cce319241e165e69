"""Load a local Hugging Face safetensors checkpoint, one shard slice per rank.

Tensors are exposed lazily through safetensors ``get_slice``: a layer indexes
only the rows or columns of its rank, and only those bytes are read from the
memory-mapped file. A TP=8 rank therefore never holds more than its eighth.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class SafetensorsSlice:
    """Adapter giving a safetensors slice the ``shape`` / ``[...]`` interface of a tensor."""

    def __init__(self, handle: Any):
        self._handle = handle
        self.shape = tuple(handle.get_shape())

    def __getitem__(self, idx: Any) -> torch.Tensor:
        if not self.shape:  # scalars cannot be sliced
            return self._handle[:]
        return self._handle[idx]


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of the index json if there is one, else all."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {root} (only safetensors checkpoints are supported)"
        )
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


def iter_safetensors(path: str | Path, device: str = "cpu", side_files: tuple[str, ...] = ()
                     ) -> Iterator[tuple[str, SafetensorsSlice | torch.Tensor]]:
    """Yield ``(name, lazy slice)`` for every tensor of the checkpoint in ``path``, then
    those of its ``side_files``: torch state dicts beside it (BGE-M3's heads), each
    tensor named under the file's stem (``sparse_linear.weight``), read with
    ``weights_only`` so no code in them runs."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device=device) as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, SafetensorsSlice(fh.get_slice(name))
    for side in side_files:
        state = torch.load(Path(path) / side, map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            yield f"{Path(side).stem}.{name}", tensor


def tensor_shape(path: str | Path, name: str) -> tuple[int, ...] | None:
    """The shape of tensor ``name`` in the checkpoint in ``path`` from the files'
    headers (None: no such tensor), without reading it."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as fh:
            if name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                return tuple(fh.get_slice(name).get_shape())
    return None


def checkpoint_names(path: str | Path) -> set[str]:
    """Every tensor name of the checkpoint (from the index, else the files' headers),
    without reading a tensor: a quantised checkpoint's loader needs to know which parts
    of a projection (zero points, a group index) exist before the first one arrives."""
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as fh:
            names.update(fh.keys())
    return names
