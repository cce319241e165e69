"""Scheduler and cache settings: small frozen dataclasses validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching policy.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes
    and prefill chunks; ``max_num_seqs`` caps running sequences; ``max_loras``
    caps the distinct LoRA adapters among them (0: no cap); ``policy`` is
    ``fcfs`` or ``priority`` (``scheduler.queues``), whose waits ``priority_aging_s``
    bounds (seconds waited that count as one priority level; None: strict).
    ``long_prefill_token_threshold`` (vLLM's; 0: off) caps the tokens one prompt may
    take in a step, so a long prompt's chunks leave room for other prompts in the
    same step instead of holding every new arrival back until it is done.
    ``max_concurrent_batches`` is how many plans may be in flight at once (a pipeline's
    stages each working on its own micro-batch, vLLM's batch queue): a plan takes
    at most its share of the running sequences and never one still in flight.
    ``output_history`` sends every sampling row's prompt and output ids to the
    sampler, as custom logits processors read them (else only where penalties,
    grammars or bad words need them).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "swap"
    max_loras: int = 0
    policy: str = "fcfs"
    priority_aging_s: float | None = None
    long_prefill_token_threshold: int = 0
    max_concurrent_batches: int = 1
    output_history: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")
        aging = self.priority_aging_s
        if aging is not None:
            if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not aging > 0:
                raise ValueError(f"priority_aging_s must be None or > 0 seconds, got {aging!r}")
            if self.policy != "priority":
                raise ValueError("priority_aging_s needs scheduling_policy='priority'")
        thr = self.long_prefill_token_threshold
        if isinstance(thr, bool) or not isinstance(thr, int) or thr < 0:
            raise ValueError("long_prefill_token_threshold must be a non-negative integer, "
                             f"got {thr!r}")
        if thr and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be a non-negative integer, got {self.max_loras!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_concurrent_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len without chunked prefill, "
                f"got {self.max_num_batched_tokens} < {self.max_model_len}"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged pool: block size, device and CPU block counts, prefix caching.

    ``enable_kv_offload`` makes the CPU tier a second level of the prefix cache
    (``scheduler.cpu_block_pool``); it needs prefix caching and CPU blocks.
    ``sliding_window`` (tokens; set when every layer of the model attends through it)
    lets a request give back the blocks no later query of it can see.
    ``kv_group_windows`` (two entries or more: a hybrid model, ``kv_groups``) gives each
    group of layers its own table, window per group; ``sliding_window`` is then None.
    ``long_rope_from`` (LongRoPE's pre-trained length; 0: not LongRoPE): a request
    longer than it runs with the long factors (``scheduler.long_rope``).
    """

    num_gpu_blocks: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    model_id: str = ""
    enable_kv_offload: bool = False
    sliding_window: int | None = None
    long_rope_from: int = 0
    kv_group_windows: tuple[int | None, ...] = ()
    # A recurrent model's prefix cache: how many state snapshots the workers keep at
    # block boundaries (``state_cache``; 0: none, and its prefix hits are never taken).
    state_snapshots: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {self.num_gpu_blocks!r}")
        if not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks!r}")
        if self.enable_kv_offload and not (self.enable_prefix_caching and self.num_cpu_blocks):
            raise ValueError("kv_offloading needs enable_prefix_caching and num_cpu_blocks > 0")
        if self.state_snapshots and (not self.enable_prefix_caching or self.enable_kv_offload
                                     or len(self.kv_group_windows) > 1):
            raise ValueError("state_snapshots need prefix caching, one KV cache group and "
                             "no offload tier")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be None or a positive integer, got {w!r}")
        groups = self.kv_group_windows
        if len(groups) > 1:
            if any(g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1)
                   for g in groups):
                raise ValueError("kv_group_windows must hold None or positive integers, "
                                 f"got {groups!r}")
            if w is not None:
                raise ValueError("kv_group_windows (a hybrid KV cache) takes no "
                                 "sliding_window (each group has its own)")
