"""One sequence the scheduler tracks: its tokens, progress and lifecycle state."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.scheduler.block_hash import BlockHash, hash_prompt_blocks
from pagedserve.scheduler.multimodal import ImageInput, check_images, rope_delta
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.scheduler.beam import BeamGroup

TOKEN_WIDTH = array("i").itemsize  # bytes per token in ``Request.token_buffer``


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


def sequence_id(group_id: str, index: int) -> str:
    """Id of sample ``index`` of a group: sample 0 keeps the group's id."""
    return group_id if index == 0 else f"{group_id}#{index}"


class Request:
    """A single sequence: a prompt plus the tokens sampled so far.

    An ``n > 1`` request is a group: sample 0 keeps the group id as its
    ``request_id`` and carries its siblings in ``pending_children`` until the
    shared prompt is computed, when the scheduler forks them onto its blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        extra_keys: Sequence[str] = (),
        group_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        lora_id: int = 0,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        images: Sequence[ImageInput] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        check_images(images, len(prompt_token_ids))
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.extra_keys = tuple(extra_keys)
        # The LoRA adapter this sequence runs with (0: the base model).
        self.lora_id = lora_id
        # Under the priority policy a lower value runs first (vLLM's convention).
        self.priority = priority
        # An embedding request: ends after its prompt, pooling hidden states instead
        # of sampling (``pooling_params``).
        self.pooling_params = pooling_params
        # The prompt's images (``multimodal``): spans of placeholder tokens whose
        # embeddings the worker replaces with the vision encoder's output.
        self.images = tuple(images)
        # Under M-RoPE, what the positions of tokens after the images are shifted by.
        self.rope_delta = rope_delta(self.images)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        # A recurrent model's state snapshots this sequence took (``state_cache``): at its
        # prompt's last block boundary, and the latest since.
        self.prompt_state: BlockHash | None = None
        self.latest_state: BlockHash | None = None
        # Where its cached KV ended past any snapshot (0: nowhere): it keeps one there.
        self.state_junction = 0
        # Leading blocks of the current table already offered to the prefix cache.
        self.num_hashed_blocks = 0
        self.pending_children: list[Request] = []
        # Speculative decoding: this step's guessed tokens, and the token ids as C
        # ints for the n-gram and suffix searches (``token_buffer``).
        self.spec_token_ids: tuple[int, ...] = ()
        # How many guesses its last step kept, when it rejected any: its next row
        # tells a recurrent model's ranks (``ScheduledRequest.draft_state``).
        self.draft_state: int | None = None
        # A draft model's guesses for the next step, with the token count they follow.
        self.draft_proposal: tuple[int, tuple[int, ...]] | None = None
        self.token_bytes: bytearray | None = None
        # A beam of a beam search: the group's search state (see ``beam``).
        self.beam: BeamGroup | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_buffer(self) -> bytearray:
        """The tokens as C ints (``TOKEN_WIDTH`` bytes each) in a ``bytearray`` that
        speculative decoding searches in place (``bytes.find``), extended as tokens
        arrive (``all_token_ids`` only ever grows), so a step converts only the new
        ones and never copies the whole sequence."""
        buf = self.token_bytes
        if buf is None:
            buf = self.token_bytes = bytearray()
        n = len(buf) // TOKEN_WIDTH
        if n < len(self.all_token_ids):
            buf += array("i", self.all_token_ids[n:]).tobytes()
        return buf

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """How sampling ``token`` (already appended) ends this sequence, if it does: a
        stop (EOS unless ignored, a stop id) or its length (``max_tokens``, the model's)."""
        p = self.sampling_params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        n = len(self.all_token_ids)
        if (p.max_tokens is not None and n - len(self.prompt_token_ids) >= p.max_tokens) or (
            n >= max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend the chained hashes to every full block of the current tokens."""
        full = self.num_tokens // block_size
        if len(self.block_hashes) < full:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(
                hash_prompt_blocks(
                    self.all_token_ids[: full * block_size],
                    block_size,
                    self.extra_keys,
                    start=len(self.block_hashes),
                    parent=parent,
                    images=self.images,
                )
            )
        return self.block_hashes

    def make_child(self, index: int) -> Request:
        """Sibling ``index`` of an ``n > 1`` group (vLLM's seed + index rule)."""
        return self._sibling(index, self.sampling_params.for_child(index))

    def make_beam(self, index: int) -> Request:
        """A new beam continuing this one: the same tokens, params and keys; the
        caller shares (forks) or recomputes the KV."""
        child = self._sibling(index, self.sampling_params)
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.beam = self.beam
        return child

    def _sibling(self, index: int, params: SamplingParams) -> Request:
        """Sequence ``index`` of this group: its prompt, keys, adapter and place in line."""
        return Request(
            sequence_id(self.group_id, index),
            self.prompt_token_ids,
            params,
            self.eos_token_ids,
            self.extra_keys,
            group_id=self.group_id,
            index=index,
            arrival_time=self.arrival_time,
            lora_id=self.lora_id,
            priority=self.priority,
            images=self.images,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
