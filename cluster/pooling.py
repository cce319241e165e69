"""Finishing embeddings: combine the runner's pooled parts of one request.

A "last"-pooled request gets one part, at its prompt's end. A "mean"-pooled
one gets a (sum, count) part per prefill chunk; a chunk starting at position
0 restarts the sum, since a request preempted by recompute runs its prompt
again from the start (mean pooling never starts from prefix-cache hits).
Then ``dimensions`` truncates (Matryoshka) and ``normalize`` scales to unit
L2 norm, as vLLM and OpenAI's ``dimensions`` do. A sequence classifier's parts
are already label logits (the rank applied its ``score`` head); its result is
their activation (``worker.classifier``): the label probabilities for
"classify", a pair's relevance for "score". The token tasks ("all" pooling) get
each chunk's rows and stack them in prompt order: every token's state
(normalised one by one) for "token_embed", every token's label probabilities
for "token_classify".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedserve.scheduler.pooling_params import TOKEN_TASKS, PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.classifier import activate


def resolved_pooling(pooling: PoolingParams | None, model_info: dict[str, Any]
                     ) -> PoolingParams | None:
    """``pooling`` with the model's own pooling type where it names none
    (``model_info["pooling_type"]``); an encoder's classifier head reads what it was
    trained on (the first token, or ModernBERT's mean), so it takes no other type."""
    if pooling is None:
        return None
    if pooling.task in TOKEN_TASKS:
        return replace(pooling, pooling_type="all")
    own = model_info.get("pooling_type") or "last"
    if own == "all":  # a token classifier: pool_for names the tasks it serves
        return pooling
    if "splade" in (own, pooling.pooling_type) and pooling.pooling_type not in (None, own):
        raise ValueError(f"pooling_type {pooling.pooling_type!r} does not apply: a SPLADE "
                         "encoder pools 'splade', and only it does")
    if pooling.pooling_type is None:
        return replace(pooling, pooling_type=own)
    if model_info.get("encoder") and model_info.get("classifier") is not None and \
            pooling.pooling_type != own:
        raise ValueError(f"this classifier's head reads {own!r} pooling; "
                         f"pooling_type {pooling.pooling_type!r} does not apply to it")
    return pooling


def probe_pooling(model_info: dict[str, Any]) -> PoolingParams | None:
    """What a health probe asks of the model: a token for a generator (None), else the
    first task it serves (a token classifier labels tokens, ColBERT embeds them)."""
    classifier, mv = model_info.get("classifier"), model_info.get("multi_vector")
    if classifier is not None:
        return PoolingParams(task="token_classify" if classifier.get("per_token")
                             else "classify")
    if mv is not None:
        return PoolingParams(task=mv["tasks"][0])
    return PoolingParams() if model_info.get("embedding_only") else None


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
    task = pooling.task
    _check_matryoshka(pooling.dimensions, model_info.get("matryoshka"))
    if model_info.get("multi_vector") is not None:
        return _multi_vector_pool(pooling, model_info)
    if classifier is None and task not in ("embed", "token_embed"):
        raise ValueError(f"task {task!r} needs a sequence classifier (a "
                         "...ForSequenceClassification checkpoint); this model embeds")
    if classifier is not None and task in ("embed", "token_embed"):
        raise ValueError("this model is a classifier: it classifies and scores "
                         "(POST /classify, /score, /rerank, /pooling), it does not embed")
    if classifier is not None and classifier.get("per_token") and task != "token_classify":
        raise ValueError(f"this model is a token classifier (...ForTokenClassification): it "
                         f"labels each token (task 'token_classify': LLM.encode, POST "
                         f"/pooling), not task {task!r}")
    if task == "token_classify" and classifier is not None and \
            model_info.get("encoder") and not classifier.get("per_token"):
        raise ValueError("task 'token_classify' needs a token classifier "
                         "(...ForTokenClassification) or a decoder's score head; this "
                         "encoder's head reads one pooled state")
    if pooling.task == "score" and classifier["num_labels"] != 1:
        raise ValueError("scoring a text pair takes a one-label classifier (a "
                         f"cross-encoder); this one has {classifier['num_labels']} labels")
    return PoolAccumulator(pooling, int(model_info["hidden_size"]), classifier)


def _check_matryoshka(dimensions: int | None, widths: list[int] | bool | None) -> None:
    """vLLM's rule where the file speaks (``config_fields.matryoshka``): only the widths
    it lists, and no cut at all on a file marked not Matryoshka. A file that says
    nothing takes any width, as OpenAI's ``dimensions`` does (vLLM refuses it)."""
    if dimensions is None or widths is None or widths is True:
        return
    if widths is False:
        raise ValueError("dimensions: this model is not a Matryoshka embedder "
                         "(is_matryoshka: false); its vectors are not meant to be cut")
    if dimensions not in widths:
        raise ValueError(f"dimensions ({dimensions}) must be one of the widths this model "
                         f"was trained for: {widths} (matryoshka_dimensions)")


def _multi_vector_pool(pooling: PoolingParams, model_info: dict[str, Any]
                       ) -> PoolAccumulator:
    """A ColBERT or BGE-M3 request's accumulator (``multi_vector_config``): its token
    vectors are the projection's width; BGE-M3's lexical weights are one raw number a
    token; the prompt's first (last) token is left out where the file says so, when
    it is the model's BOS (EOS), as vLLM does."""
    mv = model_info["multi_vector"]
    task = pooling.task
    if task not in mv["tasks"]:
        raise ValueError(f"this {mv['kind']} model serves tasks {mv['tasks']} (each "
                         "token's vector: task 'token_embed', LLM.encode, POST /pooling; "
                         "late-interaction scores: LLM.score, POST /score, /rerank), not "
                         f"task {task!r}")
    if task == "token_embed" and (pooling.dimensions or 0) > mv["dim"]:
        raise ValueError(f"dimensions ({pooling.dimensions}) exceeds the width of this "
                         f"model's token vectors ({mv['dim']})")
    acc = PoolAccumulator(pooling, mv["dim"] if task == "token_embed"
                          else int(model_info["hidden_size"]))
    acc.weights = task == "token_classify"
    if task in mv["skip_first"]:
        acc.skip_first = model_info.get("bos_token_id")
    if task in mv["skip_last"]:
        acc.skip_last = tuple(model_info.get("eos_token_ids") or ())
    return acc


class PoolAccumulator:
    """The running pooled state of one embedding request."""

    # A token task's ends left out: the first row when the prompt starts with this id,
    # the last when it ends with one of these (BGE-M3's).
    skip_first: int | None = None
    skip_last: tuple[int, ...] = ()
    weights = False  # one raw number a token (BGE-M3's lexical weights)

    def __init__(self, params: PoolingParams, hidden_size: int,
                 classifier: dict[str, Any] | None = None) -> None:
        if params.dimensions is not None and params.pooling_type == "splade":
            raise ValueError("dimensions does not apply to a SPLADE vector (one weight per "
                             "vocabulary entry)")
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(f"dimensions ({params.dimensions}) exceeds the model's hidden "
                             f"size ({hidden_size})")
        self.params = params
        self.classifier = classifier
        self.total: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []  # "all": the chunks' rows, in prompt order

    def add(self, part: Any) -> None:
        """Fold one runner part (see ``worker.pooling.pool_hidden``) in."""
        if part[0] in ("last", "cls", "whole"):
            self.total, self.count = part[1], 1
            return
        if part[0] == "all":
            _, rows, position = part
            if position == 0:  # (a recomputed prompt starts over)
                self.rows = []
            self.rows.append(rows)
            return
        _, chunk_sum, n, position = part
        if position == 0 or self.total is None:
            self.total, self.count = chunk_sum.clone(), 0
        else:
            self.total += chunk_sum
        self.count += n

    def result(self, prompt_token_ids: list[int] | None = None
               ) -> list[float] | list[list[float]]:
        """The embedding: mean (or last) state, truncated, then normalised if asked; a
        classifier's label logits through its activation (unless ``use_activation`` is
        off). The token tasks: one such row per prompt token (``prompt_token_ids`` say
        which ends a multi-vector model leaves out)."""
        if self.params.task in TOKEN_TASKS:
            if not self.rows:
                raise RuntimeError("token pooling request finished without hidden states")
            v = self._trimmed(torch.cat(self.rows), prompt_token_ids or [])
            if self.weights:
                return v[:, 0].tolist()
        elif self.total is None or self.count == 0:
            raise RuntimeError("embedding request finished without pooled hidden states")
        else:
            v = self.total / self.count
        if self.classifier is not None:
            key = "score_activation" if self.params.task == "score" else "activation"
            return (activate(v, self.classifier[key]) if self.params.use_activation
                    else v).tolist()
        if self.params.pooling_type == "splade":  # (raw, as sentence-transformers gives
            return v.tolist()  # it: its dot products are the relevance scores)
        if self.params.dimensions is not None:
            v = v[..., : self.params.dimensions]
        if self.params.normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        return v.tolist()

    def _trimmed(self, rows: torch.Tensor, ids: list[int]) -> torch.Tensor:
        if ids and self.skip_first is not None and ids[0] == self.skip_first:
            rows = rows[1:]
        if len(ids) > 1 and ids[-1] in self.skip_last:
            rows = rows[:-1]
        return rows
