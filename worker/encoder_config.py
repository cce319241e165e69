"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa, ModernBERT): what their
``config.json`` says.

These are the models most embedding and reranking deployments run (bge, e5,
gte, MiniLM sentence-transformers, ms-marco and bge cross-encoders). Unlike the
decoders they attend both ways over the whole prompt, so a token's hidden state
depends on the tokens after it: nothing of a prompt can be cached or computed
in chunks, and nothing is generated. The engine serves them with prefix caching
and chunked prefill off and no KV cache (``worker.models.bert``).

``encoder_model_config`` maps the file onto ``ModelConfig`` (heads, sizes,
labels; ``head_dim`` hidden / heads, no RoPE) plus ``EncoderConfig``: the
embedding tables (positions, token types), the post-norm eps, the activation,
and which classification head a ``...ForSequenceClassification`` file carries
(BERT's pooler then classifier, RoBERTa's dense / out_proj pair). ModernBERT's
file is read by ``modernbert_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.worker.classifier import ClassifierConfig, classifier_config
from pagedserve.worker.config_fields import positive_int, require
from pagedserve.worker.multi_vector_config import (
    MultiVectorConfig,
    is_multi_vector_architecture,
    multi_vector_config,
)
from pagedserve.worker.splade_config import splade_pooling

if TYPE_CHECKING:
    from pagedserve.worker.config import ModelConfig

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "modernbert")
# transformers' names for the activations these files use -> torch's gelu approximation.
GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
# What each family calls the encoder inside a ``...ForSequenceClassification`` file.
CHECKPOINT_PREFIX = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta.",
                     "modernbert": "model."}


@dataclass(frozen=True)
class EncoderConfig:
    """What a BERT-family encoder needs beyond ``ModelConfig``'s sizes."""

    # "bert" (pooler + classifier head), "roberta" (dense + out_proj head) or
    # "modernbert" (pre-norm, RoPE, GeGLU, local attention; ``modernbert_config``).
    family: str
    type_vocab_size: int
    position_table: int  # rows of the position embedding (``max_position_embeddings``)
    position_offset: int  # RoBERTa numbers positions from ``pad_token_id + 1``
    layer_norm_eps: float
    gelu_approximate: str  # torch's ``approximate`` for the MLP's GELU
    # A pair's second text gets token type 1 (BERT): the ids after the first separator.
    sep_token_id: int | None = None
    norm_bias: bool = True  # (ModernBERT's LayerNorms have none)
    mlp_bias: bool = True
    # Per layer: how far a token sees either way (0: the whole prompt). ModernBERT's
    # local layers see 64 tokens each side; BERT's layers see everything.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # RoPE base of the local layers (ModernBERT)
    # What the classifier head reads: the first token ("cls") or every token's mean
    # (ModernBERT's ``classifier_pooling: mean``); its activation and dense bias.
    head_pooling: str = "cls"
    head_gelu_approximate: str = "none"
    head_bias: bool = True
    # A SPLADE sparse encoder (a BERT masked-LM file with ``SpladePooling``,
    # ``splade_config``): its pooling over the tokens, "max" or "sum"; "": none.
    sparse: str = ""
    # A ColBERT or BGE-M3 file's per-token heads (``multi_vector_config``); None: none.
    multi_vector: MultiVectorConfig | None = None


def _sep_token_id(tokenizer_dir: str | None) -> int | None:
    """The tokenizer's separator id (None without a tokenizer or a separator)."""
    if tokenizer_dir is None:
        return None
    from pagedserve.worker.loaders import load_tokenizer

    try:
        tok = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError):
        return None
    sep = getattr(tok, "sep_token_id", None)
    return int(sep) if sep is not None else None


def encoder_classifier(cfg: dict[str, Any], sparse: bool = False
                       ) -> ClassifierConfig | None:
    """The file's classifier head (None: a base model, an embedder); a ``ValueError``
    for any other class. Only the base model, ``...ForSequenceClassification`` (a
    classifier or cross-encoder) and ``...ForTokenClassification`` (a tagger) are
    served, and a masked-LM file only as a SPLADE encoder (``sparse``): a masked-LM
    head generates nothing."""
    model_type = cfg["model_type"]
    arch = cfg.get("architectures") or []
    classifier = classifier_config(cfg, token_level=True)
    suffix = "ForMaskedLM" if sparse else "Model"
    base = (isinstance(arch, list) and bool(arch) and all(
        isinstance(a, str) and a.endswith(suffix) for a in arch)) or (
        not sparse and is_multi_vector_architecture(cfg))
    if classifier is None and not base:
        raise ValueError(f"model config field 'architectures' {arch!r}: a {model_type} "
                         "file is served as an embedder (...Model), a sequence classifier "
                         "(...ForSequenceClassification), a token classifier "
                         "(...ForTokenClassification) or, with sentence-transformers' "
                         "SpladePooling, a SPLADE encoder (...ForMaskedLM); HF_ColBERT "
                         "and BgeM3EmbeddingModel are multi-vector encoders")
    if classifier is not None and classifier.from_tokens:
        raise ValueError("classifier_from_token is for decoders with an LM head; this "
                         f"{model_type} file has none")
    return classifier


def _sparse(cfg: dict[str, Any], model_dir: str | None) -> str:
    """A masked-LM file's SPLADE pooling ("" for any other file); SPLADE on anything
    but BERT is refused by name."""
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and arch and all(
            isinstance(a, str) and a.endswith("ForMaskedLM") for a in arch)):
        return ""
    strategy = splade_pooling(model_dir) or ""
    if strategy and cfg["model_type"] != "bert":
        raise ValueError(f"SPLADE sparse encoders are served for BERT files, not "
                         f"model_type {cfg['model_type']!r}")
    return strategy


def gelu_approximate(cfg: dict[str, Any], field: str, default: str) -> str:
    """torch's GELU ``approximate`` for the activation named in ``cfg[field]``."""
    act = cfg.get(field, default)
    if act not in GELU:
        raise ValueError(f"model config field {field!r} must be one of {sorted(GELU)}, "
                         f"got {act!r}")
    return GELU[act]


def encoder_model_config(cls: type[ModelConfig], cfg: dict[str, Any],
                         tokenizer_dir: str | None) -> ModelConfig:
    """``ModelConfig`` of a BERT / RoBERTa / XLM-R / ModernBERT ``config.json`` (with any
    overrides)."""
    model_type = cfg["model_type"]
    if model_type == "modernbert":
        from pagedserve.worker.modernbert_config import modernbert_model_config

        return modernbert_model_config(cls, cfg)
    sparse = _sparse(cfg, tokenizer_dir)
    classifier = encoder_classifier(cfg, bool(sparse))
    multi_vector = multi_vector_config(cfg, tokenizer_dir)
    if multi_vector is not None and classifier is not None:
        raise ValueError(f"a {multi_vector.kind} file embeds tokens; it is not also a "
                         "classifier (architectures)")
    hidden = positive_int("hidden_size", require(cfg, "hidden_size"))
    heads = positive_int("num_attention_heads", require(cfg, "num_attention_heads"))
    if hidden % heads:
        raise ValueError(f"model config field 'num_attention_heads' ({heads}) must divide "
                         f"hidden_size ({hidden})")
    pos_type = cfg.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError("model config field 'position_embedding_type' must be 'absolute', "
                         f"got {pos_type!r}")
    table = positive_int("max_position_embeddings", require(cfg, "max_position_embeddings"))
    offset = 0
    if model_type != "bert":  # RoBERTa's positions start after the padding index
        pad = cfg.get("pad_token_id", 1)
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise ValueError(f"model config field 'pad_token_id' must be an integer >= 0, "
                             f"got {pad!r}")
        offset = pad + 1
    if table <= offset:
        raise ValueError(f"model config field 'max_position_embeddings' ({table}) leaves no "
                         f"position after the offset {offset}")
    types = positive_int("type_vocab_size", cfg.get("type_vocab_size", 2))
    eps = cfg.get("layer_norm_eps", 1e-12)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ValueError(f"model config field 'layer_norm_eps' must be a positive number, "
                         f"got {eps!r}")
    encoder = EncoderConfig(
        family="bert" if model_type == "bert" else "roberta", type_vocab_size=types,
        position_table=table, position_offset=offset, layer_norm_eps=float(eps),
        gelu_approximate=gelu_approximate(cfg, "hidden_act", "gelu"),
        sep_token_id=_sep_token_id(tokenizer_dir) if types > 1 else None, sparse=sparse,
        multi_vector=multi_vector)
    eos = cfg.get("eos_token_id")
    return cls(
        model_type=model_type,
        num_layers=positive_int("num_hidden_layers", require(cfg, "num_hidden_layers")),
        hidden_size=hidden,
        intermediate_size=positive_int("intermediate_size",
                                       require(cfg, "intermediate_size")),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        vocab_size=positive_int("vocab_size", require(cfg, "vocab_size")),
        rope_theta=0.0, rope_scaling=None, rms_norm_eps=float(eps),
        tie_word_embeddings=False, qkv_bias=True, o_bias=True, qk_norm=False,
        max_position_embeddings=table - offset,  # the longest prompt it can number
        sliding_window=None,
        eos_token_ids=() if eos is None else (tuple(eos) if isinstance(eos, list)
                                              else (int(eos),)),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        embedding_only=classifier is None,
        classifier=classifier,
        encoder=encoder,
    )
