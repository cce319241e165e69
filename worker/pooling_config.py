"""A model's own pooling: what its sentence-transformers files say, else its kind's.

sentence-transformers models (most embedders: bge, e5, gte, MiniLM) list their
modules in ``modules.json``; the ``Pooling`` module's folder holds a
``config.json`` whose ``pooling_mode_*`` flags say which states make the
vector (``pooling_mode_cls_token``, ``pooling_mode_mean_tokens``,
``pooling_mode_lasttoken``). vLLM reads the same file. Without one, an encoder
pools its first token (``[CLS]``, the token BERT's heads read) and a decoder
its last (the only one that has seen the whole prompt). A classifier's head
decides for itself: an encoder's reads the first token (ModernBERT's may read the
mean, ``classifier_pooling``), a decoder's the last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.worker.config import ModelConfig
from pagedserve.worker.st_modules import module_folder

# sentence-transformers' flags -> our pooling types (max / weighted mean: not served).
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_lasttoken": "last"}
_UNSERVED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
             "pooling_mode_weightedmean_tokens")


def sentence_transformers_pooling(path: str | Path) -> str | None:
    """The pooling type the model's sentence-transformers config names (None: no such
    config); a mode not served here is a ``ValueError`` naming it."""
    folder = module_folder(path, ".Pooling")
    cfg_file = folder / "config.json" if folder is not None else None
    if cfg_file is None or not cfg_file.is_file():
        return None
    cfg: dict[str, Any] = json.loads(cfg_file.read_text())
    mode = cfg.get("pooling_mode")  # (newer files may name it directly)
    if isinstance(mode, str):
        named = {"cls": "cls", "mean": "mean", "lasttoken": "last"}.get(mode)
        if named is None:
            raise ValueError(f"sentence-transformers pooling_mode {mode!r} is not served "
                             "(cls, mean and lasttoken are)")
        return named
    on = [flag for flag in (*_MODES, *_UNSERVED) if cfg.get(flag)]
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"sentence-transformers pooling {on or 'none'} is not served: one "
                         f"of {sorted(_MODES)} must be the only mode on")
    return _MODES[on[0]]


def default_pooling_type(path: str | Path, mc: ModelConfig) -> str:
    """The pooling a request gets when it names none (see the module docstring)."""
    first_token = "cls" if mc.encoder is not None else "last"
    if mc.encoder is not None and mc.encoder.sparse:
        return "splade"  # (its masked-LM head pooled over the prompt)
    if mc.classifier is not None and mc.classifier.per_token:
        return "all"  # (a token classifier labels every token)
    if mc.classifier is not None:  # (what its head was trained on)
        return mc.encoder.head_pooling if mc.encoder is not None else first_token
    return sentence_transformers_pooling(path) or first_token
