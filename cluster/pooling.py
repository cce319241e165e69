"""Finishing embeddings: combine the runner's pooled parts of one request.

A "last"-pooled request gets one part, at its prompt's end. A "mean"-pooled
one gets a (sum, count) part per prefill chunk; a chunk starting at position
0 restarts the sum, since a request preempted by recompute runs its prompt
again from the start (mean pooling never starts from prefix-cache hits).
Then ``dimensions`` truncates (Matryoshka) and ``normalize`` scales to unit
L2 norm, as vLLM and OpenAI's ``dimensions`` do. A sequence classifier's parts
are already label logits (the rank applied its ``score`` head); its result is
their activation (``worker.classifier``): the label probabilities for
"classify", a pair's relevance for "score".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.classifier import activate


def resolved_pooling(pooling: PoolingParams | None, model_info: dict[str, Any]
                     ) -> PoolingParams | None:
    """``pooling`` with the model's own pooling type where it names none
    (``model_info["pooling_type"]``); an encoder's classifier head reads what it was
    trained on (the first token, or ModernBERT's mean), so it takes no other type."""
    if pooling is None:
        return None
    own = model_info.get("pooling_type") or "last"
    if pooling.pooling_type is None:
        return replace(pooling, pooling_type=own)
    if model_info.get("encoder") and model_info.get("classifier") is not None and \
            pooling.pooling_type != own:
        raise ValueError(f"this classifier's head reads {own!r} pooling; "
                         f"pooling_type {pooling.pooling_type!r} does not apply to it")
    return pooling


def pool_for(pooling: PoolingParams | None, params: SamplingParams,
             model_info: dict[str, Any]) -> PoolAccumulator | None:
    """The accumulator of a request (None: it generates), or a ``ValueError`` when the
    model cannot answer it: a model without an LM head does not generate, and only a
    sequence classifier classifies (and scores one pair as one prompt)."""
    classifier = model_info.get("classifier")
    if pooling is None:
        if model_info.get("embedding_only"):
            raise ValueError("this model is an embedding model (a base-model checkpoint "
                             "without an LM head): it serves embeddings only "
                             "(POST /v1/embeddings, LLM.embed)")
        if classifier is not None:
            raise ValueError("this model is a sequence classifier (no LM head): it serves "
                             "classify and score only (POST /classify, /score, /rerank; "
                             "LLM.classify, LLM.score)")
        return None
    if params.n != 1:
        raise ValueError("n must be 1 for an embedding request")
    if classifier is None and pooling.task != "embed":
        raise ValueError(f"task {pooling.task!r} needs a sequence classifier (a "
                         "...ForSequenceClassification checkpoint); this model embeds")
    if classifier is not None and pooling.task == "embed":
        raise ValueError("this model is a sequence classifier: it classifies and scores "
                         "(POST /classify, /score, /rerank), it does not embed")
    if pooling.task == "score" and classifier["num_labels"] != 1:
        raise ValueError("scoring a text pair takes a one-label classifier (a "
                         f"cross-encoder); this one has {classifier['num_labels']} labels")
    return PoolAccumulator(pooling, int(model_info["hidden_size"]), classifier)


class PoolAccumulator:
    """The running pooled state of one embedding request."""

    def __init__(self, params: PoolingParams, hidden_size: int,
                 classifier: dict[str, Any] | None = None) -> None:
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(f"dimensions ({params.dimensions}) exceeds the model's hidden "
                             f"size ({hidden_size})")
        self.params = params
        self.classifier = classifier
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, part: Any) -> None:
        """Fold one runner part (see ``worker.pooling.pool_hidden``) in."""
        if part[0] in ("last", "cls", "whole"):
            self.total, self.count = part[1], 1
            return
        _, chunk_sum, n, position = part
        if position == 0 or self.total is None:
            self.total, self.count = chunk_sum.clone(), 0
        else:
            self.total += chunk_sum
        self.count += n

    def result(self) -> list[float]:
        """The embedding: mean (or last) state, truncated, then normalised if asked; a
        classifier's label logits through its activation (unless ``use_activation`` is
        off)."""
        if self.total is None or self.count == 0:
            raise RuntimeError("embedding request finished without pooled hidden states")
        v = self.total / self.count
        if self.classifier is not None:
            key = "score_activation" if self.params.task == "score" else "activation"
            return (activate(v, self.classifier[key]) if self.params.use_activation
                    else v).tolist()
        if self.params.dimensions is not None:
            v = v[: self.params.dimensions]
        if self.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()
