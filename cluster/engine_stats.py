"""What ``LLMEngine.get_stats`` reports (``/v1/stats``, Prometheus through
``cluster.metrics``): the counters summed over the engine's steps, and the queues,
memory, cache, speculative decoding, adapter and expert-parallel figures read from its
scheduler and model info when asked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.worker.layers.expert_placement import balance

if TYPE_CHECKING:
    from pagedserve.cluster.engine import LLMEngine

# Counted over the steps (shared_prefix_*: the backend's take_counters; expert_parallel_*,
# the routed layers' ``take_expert_load``, appear once counted).
STAT_COUNTERS = ("steps", "prompt_tokens", "generation_tokens", "finished_requests",
                 "aborted_requests", "execute_seconds", "kv_exported_blocks",
                 "kv_imported_blocks", "kv_import_failures", "shared_prefix_steps",
                 "shared_prefix_rows", "shared_prefix_keys_saved", "pipelined_steps")


def engine_stats(engine: LLMEngine) -> dict[str, Any]:
    """The engine's counters and its current state, as one JSON-able dict."""
    sched, mem = engine.scheduler, engine.scheduler.memory_stats().as_dict()
    queues = {"running": sched.running, "waiting": sched.waiting, "swapped": sched.swapped}
    info = engine.model_info
    return {
        **engine.stats,
        **{f"num_{name}": len(q) for name, q in queues.items()},
        "num_preemptions": dict(sched.num_preemptions),
        "prefix_cache_queries": sched.kv.prefix_queries,
        "prefix_cache_hits": sched.kv.prefix_hits,
        "kv_offload": {"enabled": sched.kv.offload_enabled, **sched.kv.offload_stats},
        "spec_decode": dict(sched.spec_stats),
        "lora": engine.loras.stats(queues),
        "memory": {**mem, **{k: info.get(k) for k in (
            "kv_cache_dtype", "quantization", "checkpoint_quantization")},
                   "bytes_per_block": int(info["bytes_per_block"]),
                   "weight_bytes": int(info.get("weight_bytes", 0))},
        "model": engine.model_id,
        "batch_invariant": engine.config.batch_invariant,
        "expert_parallel_balance": balance(engine.stats, engine.config.tensor_parallel_size),
    }
