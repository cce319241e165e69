"""What the engine returns per request, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    """One sample of a request; ``text``, ``token_ids`` and ``logprobs`` are cumulative
    (only what is new in a ``RequestOutput`` whose ``delta`` is set)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A snapshot of a request after a step (or at the end, for ``LLM.generate``).

    ``prompt_logprobs`` (when asked for) has one entry per prompt token, the
    first None: the token's logprob plus the top alternatives, as in vLLM;
    ``prompt_logprob_ranks`` the token's rank among all (1: the likeliest).
    ``embedding`` is set once an embedding (pooling) request has finished;
    ``kv_transfer`` (a ``KVPayload``) once an ``export_kv`` request has.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | list[list[float]] | None = None  # (token tasks: a row a token)
    kv_transfer: Any = None
    prompt_logprob_ranks: list[int | None] | None = None
    delta: bool = False  # outputs hold only what is new since the request's previous one


@dataclass
class EmbeddingOutput:
    """vLLM's: the pooled vector of one input."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per input (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """vLLM's: how related the two texts of a pair are."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's shape; the ids are both texts')."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's: a classifier's label probabilities (raw logits when ``use_activation``
    is off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per input (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    """vLLM's: a pooling request's raw result; for the token tasks a ``[tokens, width]``
    tensor (each token's state, or its label probabilities)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode`` returns per input (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
