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

STRATEGIES = ("max", "sum")


def splade_pooling(path: str | Path | None) -> str | None:
    """The ``SpladePooling`` strategy ("max" or "sum") the folder's ``modules.json``
    names (None: no such module); an unserved strategy or activation is a
    ``ValueError`` naming it."""
    if path is None:
        return None
    modules = Path(path) / "modules.json"
    if not modules.is_file():
        return None
    try:
        listed = json.loads(modules.read_text())
    except ValueError as exc:
        raise ValueError(f"modules.json is not valid JSON: {exc}") from None
    for m in listed if isinstance(listed, list) else ():
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".SpladePooling"):
            cfg_file = Path(path) / str(m.get("path", "")) / "config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            strategy = cfg.get("pooling_strategy", "max")
            if strategy not in STRATEGIES:
                raise ValueError(f"SpladePooling pooling_strategy must be one of "
                                 f"{STRATEGIES}, got {strategy!r}")
            activation = cfg.get("activation_function", "relu")
            if activation != "relu":
                raise ValueError("SpladePooling activation_function must be 'relu' "
                                 f"(log(1 + relu(logit))), got {activation!r}")
            return strategy
    return None
