"""SPLADE sparse encoders: what a sentence-transformers ``SparseEncoder`` folder says.

A SPLADE model (naver/splade-v3, the splade-cocondenser files, Splade_PP) is a
BERT masked-LM file whose ``modules.json`` lists an ``MLMTransformer`` and a
``SpladePooling`` module: each token's masked-LM logits become
``log(1 + relu(logit))``, and the prompt's vector is their max (or sum) over the
tokens, one weight per vocabulary entry, nearly all zero. Its dot product with
another such vector is the relevance score.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.worker.st_modules import module_folder

STRATEGIES = ("max", "sum")


def splade_pooling(path: str | Path | None) -> str | None:
    """The ``SpladePooling`` strategy ("max" or "sum") the folder's ``modules.json``
    names (None: no such module); an unserved strategy or activation is a
    ``ValueError`` naming it."""
    folder = module_folder(path, ".SpladePooling") if path is not None else None
    if folder is None:
        return None
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    strategy = cfg.get("pooling_strategy", "max")
    if strategy not in STRATEGIES:
        raise ValueError(f"SpladePooling pooling_strategy must be one of {STRATEGIES}, "
                         f"got {strategy!r}")
    activation = cfg.get("activation_function", "relu")
    if activation != "relu":
        raise ValueError("SpladePooling activation_function must be 'relu' "
                         f"(log(1 + relu(logit))), got {activation!r}")
    return strategy
