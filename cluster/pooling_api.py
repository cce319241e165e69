"""The pooling routes: OpenAI's ``POST /v1/embeddings``, vLLM's ``POST /classify`` and
``POST /pooling`` (the token tasks: a row per prompt token), and vLLM's ``POST
/score`` and ``POST /rerank`` (also under ``/v1/``) on top of them.

Score and rerank answer how related two texts are as vLLM does. An embedding model
(a bi-encoder) gives the cosine similarity of their embeddings: every distinct
text is embedded once, through the same replicas, router and continuous batches as
``/v1/embeddings``, and each pair's score is the dot product of the two unit
vectors; a ColBERT model (``multi_vector_config``) gives their late interaction,
MaxSim over the two texts' token vectors. A one-label sequence classifier (a
cross-encoder reranker) reads each pair as one prompt and answers its activated
logit. ``/rerank`` (Jina's and Cohere's shape) orders documents by their score
against the query. The routes live on an ``APIRouter`` bound to this module's
mixin; ``OpenAIServer`` inherits it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.cluster.embeddings import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    classification_response,
    embed_all,
    embedding_response,
    pooling_response,
)
from pagedserve.cluster.late_interaction import late_interaction, pair_score
from pagedserve.cluster.pooling import pool_for
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.request_ids import request_ids
from pagedserve.cluster.responses import now
from pagedserve.cluster.router import routed_request
from pagedserve.cluster.text_pairs import pair_token_ids
from pagedserve.scheduler.pooling_params import TOKEN_TASKS, PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

router = APIRouter()


class PoolingEndpoints:
    """Mixed into ``OpenAIServer``, which provides ``_authorize``, ``_check_model``,
    ``_engine_info``, ``_chat_ids``, the engine handle (and ``_prefill``, a
    disaggregated app's prefill pool, or None), the tokenizer, ``pooling_type`` and
    ``served_name``."""

    async def _pool(self, body: Any, prompts: list[list[int]], eid: str,
                    pooling: PoolingParams, lora: Any) -> list[dict[str, Any]]:
        """Each prompt's ``{"embedding", "prompt_tokens"}`` (a classifier's: its label
        probabilities), in order; ``eid`` names the engine requests (``<eid>-<i>``),
        ``lora`` is what ``_check_model`` gave for ``body.model``."""
        info = await self._engine_info()
        params = SamplingParams(max_tokens=1)
        reqs = [dataclasses.replace(routed_request(f"{eid}-{i}", ids, params, body.cache_salt,
                                                   info, False, lora, body.priority),
                                    pooling=pooling)
                for i, ids in enumerate(prompts)]
        if self._prefill is not None and lora is None:
            # Pooling is all prefill: a disaggregated app's prefill pool takes it (the
            # decode replicas if it cannot), away from the decode streams. Adapters
            # loaded at run time live on the decode replicas, so those stay there.
            return await embed_all(self._prefill, reqs, self._engine)
        return await embed_all(self._engine, reqs)

    def _prompt_ids(self, body: Any, batch: list[str | list[int]] | None,
                    info: dict[str, Any]) -> list[list[int]]:
        """The inputs as token ids; ``batch`` None: the chat form, one prompt through
        the chat template (the server's ``_chat_ids``)."""
        if batch is not None:
            return body.token_ids(batch, self.tokenizer, info["vocab_size"],
                                  bool(info.get("encoder")))
        ids = self._chat_ids(body.messages, body.add_generation_prompt, None,
                             body.chat_template_kwargs, body.continue_final_message, info)
        return [body.truncated(ids, bool(info.get("encoder")))]

    async def _embed(self, body: Any, batch: list[str | list[int]] | None, eid: str,
                     lora: Any, normalize: bool = True, dimensions: int | None = None
                     ) -> list[dict[str, Any]]:
        """Each input's ``{"embedding", "prompt_tokens"}``, in order."""
        info = await self._engine_info()
        return await self._pool(body, self._prompt_ids(body, batch, info), eid,
                                PoolingParams(self.pooling_type, normalize, dimensions), lora)

    async def _pair_scores(self, body: Any, firsts: list[str], seconds: list[str], eid: str
                           ) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens run. A one-label sequence classifier
        (a cross-encoder) reads each pair as one prompt (``pair_token_ids``); an
        embedding model scores the cosine similarity of the two texts' embeddings
        (each distinct text embedded once)."""
        lora = self._check_model(body.model)
        info = await self._engine_info()
        classifier = info.get("classifier")
        if classifier is not None:
            if classifier["num_labels"] != 1:
                raise APIError("scoring text pairs takes a one-label classifier (a "
                               f"cross-encoder); this model has {classifier['num_labels']} "
                               "labels: use /classify", param="model")
            k = body.truncation()
            ids = [pair_token_ids(self.tokenizer, a, b, k, classifier["pair_encoding"],
                                  bool(info.get("encoder")))
                   for a, b in zip(firsts, seconds, strict=True)]
            results = await self._pool(body, ids, eid,
                                       PoolingParams(self.pooling_type, task="score"), lora)
            return ([r["embedding"][0] for r in results],
                    sum(r["prompt_tokens"] for r in results))
        texts = list(dict.fromkeys(firsts + seconds))
        if late_interaction(info):  # (ColBERT: every token's vector, then MaxSim)
            results = await self._pool(body, self._prompt_ids(body, texts, info), eid,
                                       PoolingParams(task="token_embed"), lora)
        else:
            results = await self._embed(body, texts, eid, lora)
        vecs = {t: r["embedding"] for t, r in zip(texts, results, strict=True)}
        scores = [pair_score(vecs[x], vecs[y]) for x, y in zip(firsts, seconds, strict=True)]
        return scores, sum(r["prompt_tokens"] for r in results)

    @router.post("/classify")
    @router.post("/v1/classify")
    async def classify(self, body: ClassificationRequest, raw: Request) -> dict[str, Any]:
        """vLLM's: a sequence classifier's label probabilities per input."""
        self._authorize(raw)
        rid, eid = request_ids("classify", body.request_id, raw.headers.get("x-request-id"))
        lora = self._check_model(body.model)
        batch = body.inputs()
        info = await self._engine_info()
        classifier = info.get("classifier")
        if classifier is None:
            raise APIError("this model is not a sequence classifier (a "
                           "...ForSequenceClassification checkpoint): it does not classify",
                           param="model")
        prompts = self._prompt_ids(body, batch, info)
        results = await self._pool(body, prompts, eid, PoolingParams(
            self.pooling_type, task="classify", use_activation=body.activated), lora)
        return classification_response(rid, now(), body.model or self.served_name, results,
                                       classifier["labels"])

    @router.post("/pooling")
    @router.post("/v1/pooling")
    async def pooling(self, body: PoolingRequest, raw: Request) -> dict[str, Any]:
        """vLLM's: each input's pooled result for ``task``; the token tasks give every
        prompt token's state ("token_embed") or label probabilities
        ("token_classify", a token classifier's or a decoder classifier's head)."""
        self._authorize(raw)
        rid, eid = request_ids("pool", body.request_id, raw.headers.get("x-request-id"))
        lora = self._check_model(body.model)
        batch = body.inputs()
        info = await self._engine_info()
        task = body.task or ("token_embed" if info.get("classifier") is None
                             else "token_classify")
        try:
            pooling = PoolingParams(None if task in TOKEN_TASKS else self.pooling_type,
                                    body.normalize, body.dimensions, task,
                                    body.use_activation)
            pool_for(pooling, SamplingParams(max_tokens=1), info)  # (a 400 before any run)
        except ValueError as e:
            param = "dimensions" if "dimensions" in str(e) else "task"
            raise APIError(str(e), param=param) from None
        results = await self._pool(body, self._prompt_ids(body, batch, info), eid, pooling,
                                   lora)
        return pooling_response(rid, now(), body.model or self.served_name, results,
                                body.encoding_format)

    @router.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        """OpenAI's embeddings: the model's final hidden states pooled per input."""
        self._authorize(raw)
        rid, eid = request_ids("embd", body.request_id, raw.headers.get("x-request-id"))
        batch = body.inputs()
        results = await self._embed(body, batch, eid, self._check_model(body.model),
                                    body.normalize, body.dimensions)
        return {"id": rid, "created": now(),
                **embedding_response(body.model or self.served_name, results,
                                     body.encoding_format)}

    @router.post("/score")
    @router.post("/v1/score")
    async def score(self, body: ScoreRequest, raw: Request) -> dict[str, Any]:
        """vLLM's: ``text_1`` against each ``text_2`` (or pairwise, two equal lists)."""
        self._authorize(raw)
        firsts, seconds = body.pairs()
        rid, eid = request_ids("score", body.request_id, raw.headers.get("x-request-id"))
        scores, tokens = await self._pair_scores(body, firsts, seconds, eid)
        return {"id": rid, "object": "list", "created": now(),
                "model": body.model or self.served_name,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    async def rerank(self, body: RerankRequest, raw: Request) -> dict[str, Any]:
        """Jina's / Cohere's: the documents by relevance to the query, best first."""
        self._authorize(raw)
        docs = body.checked_documents()
        rid, eid = request_ids("rerank", body.request_id, raw.headers.get("x-request-id"))
        scores, tokens = await self._pair_scores(body, [body.query] * len(docs), docs, eid)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
        return {"id": rid, "model": body.model or self.served_name,
                "usage": {"total_tokens": tokens},
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": docs[i]}}
                                if body.return_documents else {})} for i in order]}
