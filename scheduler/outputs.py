"""The step plan the scheduler emits and the runner's answer to it.

Plain picklable dataclasses without torch: they cross the Ray boundary to every
tensor-parallel rank, and the scheduler stays importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.scheduler.multimodal import (  # (plan types: workers read them here)
    ImageChunk,
    MRopeGrid,
)
from pagedserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.scheduler.beam import BeamHypothesis

# One request's prompt logprobs from one step: (first prompt position,
# [{token: logprob}, ...] with the target and the top k, [the target's rank, ...]).
PromptLogprobs = tuple[int, list[dict[int, float]], list[int]]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` are computed at positions ``num_computed_tokens ..
    num_computed_tokens + len(token_ids) - 1``; slot of position ``p`` is
    ``block_table[p // B] * B + p % B``. ``sample_ids`` lists the sequences
    that draw their next token from this row's last logits: ``[request_id]``
    for an ordinary request at the end of its prompt or in decode, every
    sibling's id when an ``n > 1`` request finishes its shared prompt, and
    ``[]`` for a prefill chunk that is not the last.
    ``output_token_ids`` (per sample id) and ``prompt_token_ids`` travel only
    for sequences whose params use penalties, which need the token history.
    ``prompt_logprob_targets`` (only for requests that asked for prompt
    logprobs) are the prompt tokens this chunk's rows predict: row ``i`` gives
    the logprob of prompt position ``num_computed_tokens + 1 + i``.
    ``lora_id`` names the LoRA adapter the row runs with (0: none).
    ``num_output_tokens`` counts the request's own output tokens before this step (its
    forked siblings have none yet): seeded draws and ``min_tokens`` read it, so they
    do not depend on worker state that a restart, a preemption or a resume loses.
    ``pooling`` ("last" or "mean") marks a row of an embedding request whose
    hidden states the runner pools; ``pool_final`` that it ends the prompt;
    ``pool_task`` what the vector is for (a multi-vector model's head goes by it).
    ``long_rope`` rotates the row's tokens by LongRoPE's long factors
    (``scheduler.long_rope``). ``group_block_tables`` are a hybrid model's tables of
    KV cache groups 1 and on (``kv_groups``); ``block_table`` is group 0's.
    ``images`` are the rows of this chunk an image's encoder output replaces, and
    ``image_spans`` the whole images (absolute positions) they belong to, each
    attending to itself both ways (``multimodal``); None without images.
    ``num_lookahead``: slots the block table holds past the row's tokens, where a
    draft model writes its guesses' KV (``spec_decode``); 0: it proposes none.
    Under M-RoPE (Qwen2-VL) a row's tokens turn by their index plus ``rope_delta``
    once past its images; a chunk that starts before its last image ends carries
    ``mrope_grids``, ``(start, rows, cols, times)`` of the images before its end, instead
    (``multimodal.mrope_grids``). A recurrent model's row resuming from a prefix hit
    names the state snapshot to start from (``restore_state``); one ending on a block
    boundary, the snapshot to keep of its state there (``save_state``;
    ``scheduler.state_cache``). ``draft_state``: the row's last step verified guesses
    and kept this many, fewer than it sent, so a recurrent model's ranks start it from
    their state after those (``worker.mamba_state``); None otherwise.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample_ids: list[str]
    sampling_params: dict[str, SamplingParams] = field(default_factory=dict)
    output_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    prompt_logprob_targets: list[int] | None = None
    draft_token_ids: tuple[int, ...] = ()
    lora_id: int = 0
    num_output_tokens: int = 0
    pooling: str | None = None
    pool_final: bool = False
    pool_task: str = "embed"
    long_rope: bool = False
    group_block_tables: list[list[int]] | None = None
    images: list[ImageChunk] | None = None
    image_spans: list[tuple[int, int]] | None = None
    num_lookahead: int = 0
    rope_delta: int = 0
    mrope_grids: tuple[MRopeGrid, ...] | None = None
    restore_state: bytes | None = None
    save_state: bytes | None = None
    draft_state: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything a worker needs for one forward; the worker never decides.

    Workers apply ``blocks_to_swap_out`` first, then ``blocks_to_swap_in``,
    then ``blocks_to_copy``, then the forward. That order is what lets the
    scheduler reuse a block freed by a swap-out in the same step.
    Pairs are ``(device_block, cpu_block)`` for swaps and ``(src, dst)`` for copies.
    ``finished_ids`` and ``aborted_ids`` let workers drop per-request state
    (e.g. seeded generators); ``dropped_states`` the recurrent-state snapshots to free
    after the forward, before the step's saves (``scheduler.state_cache``).
    """

    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    aborted_ids: list[str] = field(default_factory=list)
    dropped_states: list[bytes] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (
            self.scheduled
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
        )


@dataclass(slots=True)
class SampledToken:
    """One sampled token and, when asked for, its logprob and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """Rank 0's answer: one sampled token per sequence id in any ``sample_ids``, and
    per request that asked for them, the prompt logprobs of this step's rows as
    ``(first prompt position, [{token: logprob}, ...], [target rank, ...])``.

    Rows with draft tokens answer in ``spec_tokens`` instead of ``sampled``:
    the drafts the sampler accepted, then the token it drew itself (a
    correction, or one past the last draft when all were accepted).
    ``pooled`` answers pooling rows with an opaque per-row result (a tensor
    payload the engine combines; the scheduler only passes it on).
    ``counters`` are the attention backend's per-step counts (``take_counters``),
    which the engine sums into its stats. ``draft_tokens``: a draft model's guesses
    for each row that proposed, to verify in the row's next step.
    """

    step_id: int
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    spec_tokens: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooled: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one sequence, for the engine's detokeniser and streams.

    A beam search answers once, when it ends: ``beams`` are its best hypotheses,
    best first, under the group's id."""

    request_id: str
    group_id: str
    index: int
    new_tokens: list[SampledToken]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: Any = None
    beams: list[BeamHypothesis] | None = None
