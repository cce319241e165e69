"""Sequence classifiers: a decoder whose head scores labels instead of tokens.

Hugging Face's ``LlamaForSequenceClassification`` (and the Mistral, Qwen2/3,
Phi-3, Gemma, MoE ones) is the causal decoder without an LM head plus
``score``: a bias-free ``[num_labels, hidden]`` projection of the last token's
final (normed) hidden state. Reward models (Skywork-Reward, one label),
cross-encoder rerankers and text classifiers ship this way.

``classifier_config`` reads what the engine needs from ``config.json``: the
label count and names (``id2label``), and the activations vLLM applies, which
follow transformers' loss choice (``problem_type``): softmax over two or more
labels, sigmoid for one label or multi-label problems, none for regression;
and, for scoring text pairs (cross-encoders), sentence-transformers'
``activation_fn`` when the file names one. ``ScoreHead`` holds the projection,
whole on every rank (it is ``num_labels`` rows), and is not quantised.

A causal LM can be served as a classifier too, as vLLM does through
``hf_overrides``: ``architectures`` naming ``...ForSequenceClassification`` and
``classifier_from_token`` listing tokens whose LM-head rows become the label
rows ("no_post_processing"), or, for two tokens ``[false, true]`` with
``method: "from_2_way_softmax"`` (``is_original_qwen3_reranker: true`` says the
same), the one row ``true - false``: the sigmoid of its logit is the softmax
probability of ``true`` against ``false``, which is how Qwen3-Reranker scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ACTIVATIONS = ("softmax", "sigmoid", "identity", "tanh")
FROM_TOKEN_METHODS = ("no_post_processing", "from_2_way_softmax")
# sentence-transformers' stored activation names (``torch.nn.modules...``), as run here.
_ST_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Softmax": "softmax",
                   "Tanh": "tanh"}


@dataclass(frozen=True)
class ClassifierConfig:
    """A sequence classifier's labels and activations (see the module docstring)."""

    num_labels: int
    labels: tuple[str, ...]
    activation: str  # for ``classify``: what turns the head's logits into ``probs``
    score_activation: str  # for ``score`` of a text pair (a one-label cross-encoder)
    # A head made of LM-head rows (``classifier_from_token``): their ids, and how (one
    # of ``FROM_TOKEN_METHODS``); empty: the file's own ``score.weight``.
    from_tokens: tuple[int, ...] = ()
    method: str = ""
    # How a text pair becomes one prompt (vLLM's ``use_sep_token``): the tokenizer's
    # pair encoding (a cross-encoder's, with its separators), or the two texts joined
    # and tokenised as one (an LLM made a reranker, whose templates carry the format).
    pair_encoding: bool = True
    # A token classifier (an encoder's ``...ForTokenClassification``: NER, PII
    # tagging): its head labels every token, and it serves ``token_classify`` only.
    per_token: bool = False

    def info(self) -> dict[str, Any]:
        """The plain dict the engine gets in ``model_info["classifier"]``."""
        return {"num_labels": self.num_labels, "labels": list(self.labels),
                "activation": self.activation, "score_activation": self.score_activation,
                "pair_encoding": self.pair_encoding, "per_token": self.per_token}


def names_classifier(architectures: Any, suffix: str = "ForSequenceClassification"
                     ) -> bool:
    """True when ``architectures`` lists only ``...{suffix}`` classes."""
    if not isinstance(architectures, list) or not architectures:
        return False
    return all(isinstance(a, str) and a.endswith(suffix) for a in architectures)


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """Label names by index: ``id2label`` (keys are strings in a saved config), else
    transformers' ``LABEL_i`` for ``num_labels`` (2 when neither is given)."""
    id2label = cfg.get("id2label")
    if id2label is not None:
        if not isinstance(id2label, dict) or not id2label:
            raise ValueError("config.json: id2label must be a non-empty object")
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ValueError("config.json: id2label keys must be label indices") from None
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError("config.json: id2label must number its labels 0..n-1")
        return tuple(by_index[i] for i in range(len(by_index)))
    n = cfg.get("num_labels", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"config.json: num_labels must be a positive integer, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


def _classify_activation(problem_type: Any, num_labels: int) -> str:
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    if problem_type not in (None, "", "single_label_classification"):
        raise ValueError(f"config.json: problem_type {problem_type!r} is not one of "
                         "regression, single_label_classification, "
                         "multi_label_classification")
    return "sigmoid" if num_labels < 2 else "softmax"


def _score_activation(cfg: dict[str, Any], num_labels: int) -> str:
    st = cfg.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    if name is None:
        name = cfg.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid" if num_labels < 2 else "softmax"
    short = str(name).rsplit(".", 1)[-1]
    if not str(name).startswith("torch.nn.modules.") or short not in _ST_ACTIVATIONS:
        raise ValueError(f"config.json: cross-encoder activation {name!r} is not one of "
                         f"torch.nn.modules' {sorted(_ST_ACTIVATIONS)}")
    act = _ST_ACTIVATIONS[short]
    return ("sigmoid" if num_labels < 2 else "softmax") if act == "softmax" else act


def _from_tokens(cfg: dict[str, Any], token_ids: Callable[[list[str]], list[int]] | None
                 ) -> tuple[tuple[int, ...], str, tuple[str, ...]]:
    """``(ids, method, labels)`` of a head made of LM-head rows."""
    tokens = cfg["classifier_from_token"]
    if not isinstance(tokens, list) or not tokens or \
            not all(isinstance(t, str) and t for t in tokens):
        raise ValueError("classifier_from_token must be a non-empty list of tokens, got "
                         f"{tokens!r}")
    method = "from_2_way_softmax" if cfg.get("is_original_qwen3_reranker") else \
        cfg.get("method") or "no_post_processing"
    if method not in FROM_TOKEN_METHODS:
        raise ValueError(f"method must be one of {FROM_TOKEN_METHODS} with "
                         f"classifier_from_token, got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError("classifier_from_token needs two tokens [false, true] for "
                         f"from_2_way_softmax, got {tokens!r}")
    if token_ids is None:
        raise ValueError("classifier_from_token needs the model's tokenizer")
    ids = tuple(token_ids(tokens))
    labels = tuple(tokens[1:]) if method == "from_2_way_softmax" else tuple(tokens)
    return ids, method, labels


def classifier_config(cfg: dict[str, Any],
                      token_ids: Callable[[list[str]], list[int]] | None = None,
                      token_level: bool = False) -> ClassifierConfig | None:
    """The classifier facts of an HF ``config.json`` dict (with any ``hf_overrides``);
    None unless it names a sequence-classification architecture (or, where
    ``token_level`` allows it, a token-classification one: the encoders'). ``token_ids``
    maps ``classifier_from_token`` to ids (the model's tokenizer)."""
    if names_classifier(cfg.get("architectures"), "ForTokenClassification"):
        if not token_level:
            raise ValueError(f"architectures {cfg['architectures']!r}: token classification "
                             "is served for encoder files (BERT, RoBERTa, XLM-R, ModernBERT)")
        labels = _labels(cfg)
        activation = _classify_activation(cfg.get("problem_type"), len(labels))
        return ClassifierConfig(len(labels), labels, activation, activation, per_token=True)
    if not names_classifier(cfg.get("architectures")):
        if cfg.get("classifier_from_token") is not None:
            raise ValueError("classifier_from_token needs architectures naming a "
                             "...ForSequenceClassification class (hf_overrides)")
        return None
    ids, method = (), ""
    if cfg.get("classifier_from_token") is not None:
        ids, method, labels = _from_tokens(cfg, token_ids)
        if cfg.get("id2label") is not None:
            named = _labels(cfg)
            if len(named) != len(labels):
                raise ValueError(f"config.json: id2label names {len(named)} labels, "
                                 f"classifier_from_token makes {len(labels)}")
            labels = named
    else:
        labels = _labels(cfg)
    sep = next((cfg[k] for k in ("use_pad_token", "use_sep_token") if cfg.get(k) is not None),
               not ids)
    if not isinstance(sep, bool):
        raise ValueError(f"config.json: use_sep_token must be true or false, got {sep!r}")
    return ClassifierConfig(len(labels), labels,
                            _classify_activation(cfg.get("problem_type"), len(labels)),
                            _score_activation(cfg, len(labels)), ids, method, sep)


def vocab_token_ids(tokenizer_dir: str) -> Callable[[list[str]], list[int]]:
    """A ``token_ids`` for ``classifier_config`` from the tokenizer saved in
    ``tokenizer_dir``; a token that is not one of its tokens is a ``ValueError``."""
    def lookup(tokens: list[str]) -> list[int]:
        from pagedserve.worker.loaders import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
        ids = []
        for t in tokens:
            i = tok.convert_tokens_to_ids(t)
            if i is None or (i == tok.unk_token_id and t != tok.unk_token):
                raise ValueError(f"classifier_from_token: {t!r} is not a token of the "
                                 "model's tokenizer")
            ids.append(int(i))
        return ids

    return lookup


def merge_overrides(cfg: dict[str, Any], overrides: dict[str, Any] | None
                    ) -> dict[str, Any]:
    """``config.json`` with vLLM's ``hf_overrides`` laid over it: a key's value replaces
    the file's, an object merges into the file's object key by key."""
    if not overrides:
        return cfg
    out = dict(cfg)
    for k, v in overrides.items():
        out[k] = merge_overrides(out[k], v) if isinstance(v, dict) and \
            isinstance(out.get(k), dict) else v
    return out


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply one of ``ACTIVATIONS`` to a request's label logits (a 1-D tensor)."""
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "tanh":
        return torch.tanh(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


class ScoreHead(nn.Module):
    """The ``score`` projection, whole on each rank; applied in fp32 to pooled states
    (it is linear without a bias, so a mean-pooled sum may pass through it first)."""

    linear = True

    def __init__(self, num_labels: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)

    def load_from_vocab(self, name: str, lazy: Any, config: ClassifierConfig) -> None:
        """Build the rows from the LM head's (or the tied embedding's) rows of
        ``config.from_tokens``, read one row each, never the whole matrix."""
        vocab = lazy.shape[0]
        if tuple(lazy.shape[1:]) != tuple(self.weight.shape[1:]) or \
                any(not 0 <= i < vocab for i in config.from_tokens):
            raise ValueError(f"{name}: shape {tuple(lazy.shape)} does not hold rows "
                             f"{list(config.from_tokens)} of width {self.weight.shape[1]}")
        rows = torch.stack([lazy[i:i + 1][0].float() for i in config.from_tokens])
        if config.method == "from_2_way_softmax":
            rows = rows[1:2] - rows[0:1]
        self.weight.data.copy_(rows.to(self.weight.dtype))

    def load(self, name: str, lazy: Any) -> None:
        """Copy the checkpoint's ``score.weight``, checking its shape first."""
        if tuple(lazy.shape) != tuple(self.weight.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != "
                             f"{tuple(self.weight.shape)} (num_labels x hidden_size)")
        self.weight.data.copy_(lazy[:])

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Label logits of pooled hidden states (``[..., hidden]`` -> ``[..., labels]``)."""
        return pooled.float() @ self.weight.float().t()
