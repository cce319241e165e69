"""Multi-vector encoders: ColBERT and BGE-M3, whose files give each token its own vector.

A ColBERT file (colbert-ir/colbertv2.0, and files saved in its layout) is a BERT
encoder plus ``linear``: a projection, without bias, of every
token's final state down to ``dim`` components (128 for colbertv2.0). Its
architecture is ``HF_ColBERT`` (vLLM's ``ColBERTModel`` also names it); the
dimension is the config's ``colbert_dim``, ``dim`` or ``projection_dim``, else the
checkpoint's projection rows. It serves the token task "token_embed" (each token's
projected, unit-length vector) and late-interaction scoring (MaxSim: for each
query token its best dot product with a document token, summed): a single pooled
vector is not what its projection was trained for.

BGE-M3 (BAAI/bge-m3) is an XLM-RoBERTa encoder with two side files in its folder:
``colbert_linear.pt`` (``hidden -> dim``, with bias) and ``sparse_linear.pt``
(``hidden -> 1``). It serves three things at once, as FlagEmbedding's
``BGEM3FlagModel`` does: "embed" (the first token's state, unit length: its dense
vector), "token_embed" (its ColBERT vectors: every token but the first, projected,
unit length) and "token_classify" (its lexical weights: ``relu(sparse_linear(h))``
per token, the first and last special tokens left out). The folder is recognised
by the two side files, or by vLLM's ``hf_overrides`` architecture name
``BgeM3EmbeddingModel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.worker.config_fields import positive_int

COLBERT_ARCHITECTURES = ("HF_ColBERT", "ColBERTModel")
BGE_M3_ARCHITECTURE = "BgeM3EmbeddingModel"
BGE_M3_FILES = ("colbert_linear.pt", "sparse_linear.pt")
# The config fields that may hold a ColBERT projection's width (vLLM reads the same).
DIM_FIELDS = ("colbert_dim", "dim", "projection_dim")


@dataclass(frozen=True)
class MultiVectorConfig:
    """Which multi-vector file this is and what its heads need."""

    kind: str  # "colbert" or "bge-m3"
    dim: int  # components of a token's vector (the projection's rows)
    # Files beside the checkpoint that hold head tensors, each a torch state dict
    # whose names load under the file's stem (``sparse_linear.weight``).
    side_files: tuple[str, ...] = ()

    @property
    def tasks(self) -> tuple[str, ...]:
        """The pooling tasks the file serves."""
        return ("token_embed",) if self.kind == "colbert" else \
            ("embed", "token_embed", "token_classify")

    def info(self) -> dict[str, Any]:
        """What the engine needs: the tasks, the token vectors' width, and which ends of
        a prompt a token task leaves out (FlagEmbedding's: BGE-M3's ColBERT vectors skip
        its ``<s>``, its lexical weights ``<s>`` and ``</s>``)."""
        m3 = self.kind == "bge-m3"
        return {"kind": self.kind, "dim": self.dim, "tasks": list(self.tasks),
                "late_interaction": not m3,  # (BGE-M3 scores by its dense vector)
                "skip_first": ["token_embed", "token_classify"] if m3 else [],
                "skip_last": ["token_classify"] if m3 else []}


def _architectures(cfg: dict[str, Any]) -> list[str]:
    arch = cfg.get("architectures")
    return [a for a in arch if isinstance(a, str)] if isinstance(arch, list) else []


def is_multi_vector_architecture(cfg: dict[str, Any]) -> bool:
    """Whether ``architectures`` names only ColBERT or BGE-M3 classes (base encoders)."""
    arch = _architectures(cfg)
    return bool(arch) and len(arch) == len(cfg["architectures"]) and all(
        a in (*COLBERT_ARCHITECTURES, BGE_M3_ARCHITECTURE) for a in arch)


def multi_vector_config(cfg: dict[str, Any], model_dir: str | None
                        ) -> MultiVectorConfig | None:
    """The file's multi-vector heads (None: a plain encoder); a ``ValueError`` naming
    what is missing or wrong."""
    arch = _architectures(cfg)
    folder = Path(model_dir) if model_dir is not None else None
    if any(a in COLBERT_ARCHITECTURES for a in arch):
        if cfg["model_type"] != "bert":
            raise ValueError(f"ColBERT files are served for BERT encoders, not model_type "
                             f"{cfg['model_type']!r}")
        return MultiVectorConfig("colbert", _colbert_dim(cfg, folder))
    named = BGE_M3_ARCHITECTURE in arch
    found = folder is not None and all((folder / f).is_file() for f in BGE_M3_FILES)
    if not (named or found):
        return None
    if cfg["model_type"] != "xlm-roberta":
        raise ValueError(f"BGE-M3 is an XLM-RoBERTa encoder; this file is model_type "
                         f"{cfg['model_type']!r}")
    if not found:
        raise ValueError(f"architectures {BGE_M3_ARCHITECTURE!r} needs "
                         f"{' and '.join(BGE_M3_FILES)} beside the checkpoint")
    hidden = positive_int("hidden_size", cfg.get("hidden_size"))
    assert folder is not None
    dim = _side_rows(folder / BGE_M3_FILES[0], hidden)
    if _side_rows(folder / BGE_M3_FILES[1], hidden) != 1:
        raise ValueError(f"{BGE_M3_FILES[1]}: its weight must have one row (a token's "
                         "lexical weight)")
    return MultiVectorConfig("bge-m3", dim, BGE_M3_FILES)


def _colbert_dim(cfg: dict[str, Any], folder: Path | None) -> int:
    """The projection's width from the config, else from the checkpoint's header."""
    for field in DIM_FIELDS:
        if cfg.get(field) is not None:
            return positive_int(field, cfg[field])
    if folder is not None:
        from pagedserve.worker.loaders.hf import tensor_shape

        for name in ("linear.weight", "colbert_linear.weight"):
            shape = tensor_shape(folder, name)
            if shape is not None:
                return int(shape[0])
    raise ValueError(f"a ColBERT file needs its projection's width: one of {DIM_FIELDS} "
                     "in config.json (hf_overrides), or a 'linear.weight' in the checkpoint")


def _side_rows(path: Path, hidden: int) -> int:
    """Rows of the ``weight`` in a side file (a ``Linear``'s state dict) whose columns
    must be ``hidden``; read with ``weights_only`` (no code runs from the file)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # (a truncated or foreign file: say which)
        raise ValueError(f"{path.name}: not a torch state dict ({e})") from None
    weight = state.get("weight") if isinstance(state, dict) else None
    if weight is None or weight.dim() != 2 or weight.shape[1] != hidden:
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(f"{path.name}: needs a 'weight' of shape [rows, {hidden}], "
                         f"got {shape}")
    return int(weight.shape[0])
