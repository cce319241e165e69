"""``POST /v1/embeddings``: the OpenAI request, the replica calls, the response; the
bodies of vLLM's classify, pooling, score and rerank routes (``pooling_api``) and the
classification and pooling responses.

Each input is one engine request (``EngineRequest.pooling`` set) sent with the
prefix-affinity router like a completion, so inputs that share a prefix meet
the replica that caches it. A disaggregated app sends them to its prefill pool
(pooling is all prefill), so they never stall the decode replicas' streams. Inputs of a batch run concurrently and share the
replicas' continuous batches with generation. An embedding is idempotent, so a
replica that dies (or answers 503) before answering is retried on another.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedserve.cluster.aio import gather_or_cancel
from pagedserve.cluster.chat_protocol import ChatMessage, check_continuation, check_template_kwargs
from pagedserve.cluster.protocol import APIError, as_batch
from pagedserve.cluster.replica_calls import call_on_replicas
from pagedserve.cluster.text_pairs import MAX_INPUTS, pair_texts, truncated_ids
from pagedserve.cluster.wire import EngineRequest


def checked_truncation(k: int | None) -> int | None:
    """A body's ``truncate_prompt_tokens``: None or at least 1 (else a 400 on it)."""
    if k is not None and k < 1:
        raise APIError("truncate_prompt_tokens must be >= 1", param="truncate_prompt_tokens")
    return k


class _PooledInputs(BaseModel):
    """What embeddings and classification bodies share: text or token-id ``input``, or
    vLLM's chat form (``messages`` through the chat template, one prompt), vLLM's
    ``truncate_prompt_tokens`` and routing extras."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False  # the chat form's (vLLM's defaults for pooling)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None  # vLLM's: names the response (else X-Request-Id)

    def inputs(self) -> list[str | list[int]] | None:
        """The batch as a list (None: the chat form); an empty input or batch, neither
        or both forms, or a chat with images is a 400."""
        checked_truncation(self.truncate_prompt_tokens)
        if (self.input is None) == (self.messages is None):
            raise APIError("give either input or messages (the chat form)", param="input")
        if self.messages is None:
            return as_batch(self.input, "input", MAX_INPUTS)
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if any(m.media for m in self.messages):
            raise APIError("pooling routes take text messages only", param="messages")
        check_template_kwargs(self.chat_template_kwargs)
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        return None

    def token_ids(self, batch: list[str | list[int]], tokenizer: Any, vocab_size: int,
                  encoder: bool = False) -> list[list[int]]:
        """Each input of ``batch`` as token ids, cut to ``truncate_prompt_tokens``; ids
        outside the vocabulary are a 400."""
        out = []
        for x in batch:
            ids = tokenizer.encode(x) if isinstance(x, str) else list(x)
            if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
                raise APIError("input token ids must be within the vocabulary", param="input")
            out.append(self.truncated(ids, encoder))
        return out

    def truncated(self, ids: list[int], encoder: bool = False) -> list[int]:
        """``ids`` cut to ``truncate_prompt_tokens`` (``text_pairs.truncated_ids``)."""
        return truncated_ids(ids, self.truncate_prompt_tokens, encoder)


class EmbeddingRequest(_PooledInputs):
    """OpenAI's embeddings body, plus vLLM's ``truncate_prompt_tokens`` and ``normalize``."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool = True

    def inputs(self) -> list[str | list[int]] | None:
        if self.dimensions is not None and self.dimensions < 1:
            raise APIError("dimensions must be a positive integer", param="dimensions")
        return super().inputs()


class ClassificationRequest(_PooledInputs):
    """vLLM's ``POST /classify`` body. ``use_activation`` False returns the raw label
    logits (``activation`` is its older name)."""

    use_activation: bool | None = None
    activation: bool | None = None

    @property
    def activated(self) -> bool:
        return next((a for a in (self.use_activation, self.activation) if a is not None),
                    True)


def classification_response(rid: str, created: int, model: str,
                            results: list[dict[str, Any]], labels: list[str]
                            ) -> dict[str, Any]:
    """vLLM's classification ``list``: each input's probabilities, the likeliest label
    (``id2label``), the class count, and the prompt tokens as usage."""
    tokens = sum(r["prompt_tokens"] for r in results)
    data = []
    for i, r in enumerate(results):
        probs = r["embedding"]
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels) else None,
                     "probs": probs, "num_classes": len(probs)})
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None}}


class PoolingRequest(_PooledInputs):
    """vLLM's ``POST /pooling`` body: ``task`` (None: the model's token task,
    "token_classify" for a classifier, else "token_embed"; "embed" and "classify"
    give one vector per input), with the embeddings' and classification's options."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool = True
    use_activation: bool = True


def pooling_response(rid: str, created: int, model: str, results: list[dict[str, Any]],
                     fmt: str) -> dict[str, Any]:
    """vLLM's pooling ``list``: each input's result as ``data`` (a token task's: a row
    per token; ``base64``: the rows' float32 bytes end to end), with token usage."""
    tokens = sum(r["prompt_tokens"] for r in results)
    data = []
    for i, r in enumerate(results):
        value = r["embedding"]
        if fmt == "base64":
            flat = [x for row in value for x in row] if value and \
                isinstance(value[0], list) else value
            value = encode_vector(flat, fmt)
        data.append({"index": i, "object": "pooling", "data": value})
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None}}


class _TextPairs(BaseModel):
    """What score and rerank share: the model, vLLM's routing extras, and text inputs
    turned into token ids like embeddings' (``truncate_prompt_tokens`` too)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None  # vLLM's: names the response (else X-Request-Id)

    def truncation(self) -> int | None:
        """``truncate_prompt_tokens``, checked (a 400 below 1)."""
        return checked_truncation(self.truncate_prompt_tokens)

    def token_ids(self, batch: list[str | list[int]], tokenizer: Any, vocab_size: int,
                  encoder: bool = False) -> list[list[int]]:
        k = self.truncation()
        return [truncated_ids(tokenizer.encode(x), k, encoder) for x in batch]


class ScoreRequest(_TextPairs):
    """vLLM's ``POST /score``: ``text_1`` (one text, or a list as long as ``text_2``)
    against ``text_2``."""

    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> tuple[list[str], list[str]]:
        try:
            return pair_texts(self.text_1, self.text_2)
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None


class RerankRequest(_TextPairs):
    """Jina's / Cohere's ``POST /rerank`` (vLLM serves it too)."""

    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True

    def checked_documents(self) -> list[str]:
        if not self.query:
            raise APIError("query must not be empty", param="query")
        if not self.documents or not all(self.documents):
            raise APIError("documents must be a non-empty list of non-empty texts",
                           param="documents")
        if len(self.documents) > MAX_INPUTS:
            raise APIError(f"at most {MAX_INPUTS} documents per request", param="documents")
        if self.top_n is not None and self.top_n < 1:
            raise APIError("top_n must be a positive integer", param="top_n")
        return list(self.documents)


async def embed_all(handle: Any, reqs: list[EngineRequest], fallback: Any = None
                    ) -> list[dict[str, Any]]:
    """Every input's answer, in order; the first failure cancels the others (their
    replicas abort them) and is raised."""
    return await gather_or_cancel([embed_on_replicas(handle, r, fallback) for r in reqs])


async def embed_on_replicas(handle: Any, req: EngineRequest, fallback: Any = None
                            ) -> dict[str, Any]:
    """One input's ``EngineServer.embed`` answer, retried on another replica when one
    fails; errors become :class:`APIError` (400 for the input, 503 otherwise). With a
    ``fallback`` pool (a disaggregated app's decode replicas, behind its prefill pool),
    an input that no replica of ``handle`` could take runs there instead."""
    try:
        return await call_on_replicas(handle, "embed", req, what="embed the input")
    except APIError as e:
        if fallback is None or e.status != 503:
            raise
    return await call_on_replicas(fallback, "embed", req, what="embed the input")


def encode_vector(vec: list[float], fmt: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32 bytes, as OpenAI sends."""
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def embedding_response(model: str, results: list[dict[str, Any]], fmt: str
                       ) -> dict[str, Any]:
    """The OpenAI ``list`` of ``embedding`` objects, with token usage."""
    tokens = sum(r["prompt_tokens"] for r in results)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_vector(r["embedding"], fmt)}
                     for i, r in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
