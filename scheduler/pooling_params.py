"""What an embedding (pooling) request asks for: vLLM's ``PoolingParams``, pure Python.

A pooling request runs its prompt through the model and ends without
sampling: its result is one vector made of the final hidden states (after the
model's last norm). ``pooling_type`` "last" takes the last token's state (the
decoder embedders' choice: e5-mistral, gte-Qwen2, Qwen3-Embedding), "mean"
averages every token's, "cls" takes the first token's (BERT-family embedders:
bge, and their classifiers' heads); None is the model's own choice
(``model_info["pooling_type"]``: its sentence-transformers pooling, else "cls" for
an encoder and "last" for a decoder), which the engine fills in. ``normalize``
makes the vector unit length (L2), and ``dimensions`` keeps only the first that
many components before normalising (Matryoshka embeddings, OpenAI's
``dimensions``).

``task`` says what the pooled vector is for: "embed" (an embedding model's
vector), or, on a sequence classifier (``worker.classifier``), "classify" (the
label probabilities) or "score" (a text pair's relevance, one number);
``use_activation`` False returns a classifier's raw label logits (vLLM's).
vLLM's token tasks pool nothing ("all": every prompt token's row): "token_embed"
gives each token's final state (normalised one by one), "token_classify" each
token's label probabilities (a token classifier's, such as a BERT NER file, or a
decoder sequence classifier's head on every prefix). A SPLADE encoder pools
"splade": its masked-LM logits over the whole prompt into one vocabulary-wide
sparse vector (``worker.splade_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls", "all", "splade")
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingParams:
    """How one request's hidden states become its embedding."""

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None
    task: str = "embed"
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, "
                             f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool, got {self.use_activation!r}")
        if d is not None and self.task not in ("embed", "token_embed"):
            raise ValueError("dimensions is for embeddings, not for task "
                             f"{self.task!r}")
        if (self.pooling_type == "all") != (self.task in TOKEN_TASKS) and \
                self.pooling_type is not None:
            raise ValueError(f"pooling_type {self.pooling_type!r} does not apply to task "
                             f"{self.task!r} (the token tasks {TOKEN_TASKS} and only they "
                             "pool 'all')")

    @property
    def needs_every_position(self) -> bool:
        """Mean, first-token and every-token pooling read prompt tokens from the first one
        on, so a prefix-cache hit (which skips them) cannot serve them."""
        return self.pooling_type in ("mean", "cls", "all", "splade") or \
            self.task in TOKEN_TASKS
