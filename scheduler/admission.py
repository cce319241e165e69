"""What may enter a replica's batch: requests that could ever run, and the adapter cap.

Pure functions of a request and the settings, kept apart from the batching
policy in :mod:`scheduler` so each rule reads (and is tested) on its own.
"""

from __future__ import annotations

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import cdiv
from pagedserve.scheduler.multimodal import check_images_fit
from pagedserve.scheduler.request import Request


def check_fits(request: Request, config: SchedulerConfig, block_size: int,
               pool_blocks: int, windows: tuple[int | None, ...] = (None,)) -> None:
    """Reject at admission what could never run, instead of waiting forever. ``windows``
    has one entry per block table a request keeps (one, or a hybrid model's groups):
    under a sliding window whose blocks are released behind it, that table holds at
    most the window's blocks plus one step's."""
    n = request.num_prompt_tokens
    max_len = config.max_model_len
    if request.pooling_params is not None:  # no token is generated: the prompt may fill it
        if n > max_len:
            raise ValueError(f"input is {n} tokens, the model's context is {max_len}")
        if _held(n, config, block_size, windows) > pool_blocks:
            raise ValueError(f"input needs {_held(n, config, block_size, windows)} KV blocks "
                             f"for {n} tokens, the pool has {pool_blocks}")
    elif n >= max_len:
        raise ValueError(
            f"prompt is {n} tokens, the model's context is {max_len} "
            "(at least one token must be generated)"
        )
    else:
        _check_total(request, n, config, block_size, pool_blocks, windows)
    if not config.enable_chunked_prefill and n > config.max_num_batched_tokens:
        raise ValueError(
            f"prompt of {n} tokens exceeds max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) without chunked prefill"
        )
    check_images_fit(request.images, config.max_num_batched_tokens,
                     config.long_prefill_token_threshold)


def blocks_held(tokens: int, config: SchedulerConfig, block_size: int,
                window: int | None) -> int:
    """The most blocks a request of ``tokens`` tokens holds at once: all of them, or
    under a released sliding window those of the window and of one step's tokens."""
    whole = cdiv(tokens, block_size)
    if window is None:
        return whole
    return min(whole, cdiv(window - 1 + config.max_num_batched_tokens, block_size) + 1)


def max_tokens_held(config: SchedulerConfig, block_size: int, pool_blocks: int,
                    windows: tuple[int | None, ...]) -> int:
    """The longest request ``check_fits`` admits to a pool of ``pool_blocks``: its full
    tables' blocks after every sliding table's bound (the context when all slide)."""
    full = sum(w is None for w in windows)
    if not full:
        return config.max_model_len
    bound = sum(blocks_held(1 << 40, config, block_size, w) for w in windows if w is not None)
    return max(0, (pool_blocks - bound) // full * block_size)


def _held(tokens: int, config: SchedulerConfig, block_size: int,
          windows: tuple[int | None, ...]) -> int:
    return sum(blocks_held(tokens, config, block_size, w) for w in windows)


def _check_total(request: Request, n: int, config: SchedulerConfig, block_size: int,
                 pool_blocks: int, windows: tuple[int | None, ...]) -> None:
    """Prompt plus ``max_tokens`` (or up to the context) must fit the context and pool."""
    max_len = config.max_model_len
    max_tokens = request.sampling_params.max_tokens
    total = n + (max_tokens if max_tokens is not None else max_len - n)
    if total > max_len:
        raise ValueError(
            f"max_tokens: prompt ({n}) + max_tokens ({max_tokens}) = {total} "
            f"exceeds the model's context of {max_len} tokens"
        )
    if _held(total, config, block_size, windows) > pool_blocks:
        raise ValueError(
            f"request needs {_held(total, config, block_size, windows)} KV blocks for "
            f"{total} tokens, the pool has {pool_blocks}"
        )


def lacks_room(req: Request, num_running: int, config: SchedulerConfig, block_size: int,
               free_blocks: int, num_tables: int = 1) -> bool:
    """Whether ``req`` lacks a seat, or the blocks of its first chunk in each of its
    ``num_tables`` tables (prefix-cache hits not counted), for the priority policy's
    preemption of less urgent requests."""
    if num_running >= config.max_num_seqs:
        return True
    cap = min(config.max_num_batched_tokens, config.max_model_len)
    chunk = cdiv(min(req.num_tokens - req.num_computed_tokens, cap), block_size)
    return chunk * num_tables > free_blocks


def lora_fits(req: Request, active: set[int], cap: int) -> bool:
    """Whether running ``req`` keeps the distinct adapters of ``active`` (the running
    ones) at most ``cap`` (0: no cap); if so, its adapter joins ``active``."""
    if not cap or not req.lora_id or req.lora_id in active:
        return True
    if len(active) >= cap:
        return False
    active.add(req.lora_id)
    return True
