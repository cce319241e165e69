"""LongRoPE's switch from its short to its long factors (Phi-3-128k, Phi-3.5, Phi-4-mini),
as transformers makes it.

transformers rotates a forward's tokens by the long factors when the sequence is longer
than the pre-trained length (``original_max_position_embeddings``), and Phi-3's
``prepare_inputs_for_generation`` drops the KV cache when a sequence first grows past it,
so the whole sequence is computed again with the long factors. Here a request whose
prompt is already longer starts long; one that grows past the length during decode is
recomputed (its blocks freed, its prompt and outputs prefilled again), as a preemption
in recompute mode would. A long request's blocks hash under their own key: the same
tokens rotated by other factors are other K/V, so the prefix cache never mixes them.
"""

from __future__ import annotations

from pagedserve.scheduler.request import Request

LONG_ROPE_KEY = "rope:long"


def prompt_keys(keys: tuple[str, ...], num_tokens: int, long_rope_from: int
                ) -> tuple[str, ...]:
    """The hash keys of a prompt of ``num_tokens`` tokens: ``keys``, and LongRoPE's past
    its pre-trained length (``long_rope_from``; 0: not LongRoPE), where it runs long.
    The scheduler and the router (its prefix affinity) both name blocks this way."""
    return (*keys, LONG_ROPE_KEY) if long_rope_from and num_tokens > long_rope_from else keys


def uses_long_rope(req: Request) -> bool:
    """Whether the request's K/V are (to be) rotated by the long factors."""
    return LONG_ROPE_KEY in req.extra_keys


def start_long_rope(req: Request) -> None:
    """From now on the request runs long: its blocks hash under the long key (its
    hashes so far named short-rotated blocks, so they are dropped)."""
    req.extra_keys = (*req.extra_keys, LONG_ROPE_KEY)
    req.block_hashes = []
    req.num_hashed_blocks = 0


def needs_long_rope(req: Request, original_max: int) -> bool:
    """Whether the request has outgrown the short factors but is not long yet."""
    return bool(original_max) and not uses_long_rope(req) and (
        len(req.all_token_ids) > original_max)
