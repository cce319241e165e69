"""What every rank of an engine loads and sizes: an ``EngineConfig`` turned into the
``WorkerConfig`` its ranks start from (``engine_setup`` builds it once per engine)."""

from __future__ import annotations

from pagedserve.cluster.config import ENGINE_CPU_KV_BYTES, EngineConfig
from pagedserve.cluster.recurrent_engine import is_recurrent, state_snapshots
from pagedserve.scheduler.spec_decode import OWN_HEAD_METHODS
from pagedserve.worker.worker_config import WorkerConfig


def worker_config_for(config: EngineConfig, model_path: str, device: str) -> WorkerConfig:
    """What every rank of this engine loads and sizes (``model_path``: the resolved
    local checkpoint). The largest step the scheduler may plan sizes the CUDA
    profiling forward; without chunked prefill a whole prompt is one step (the
    worker caps it at the model's length)."""
    step_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    if not config.enable_chunked_prefill:
        step_tokens = max(step_tokens, config.max_model_len or 2**31 - 1)
    spec = config.speculative_config
    assert not isinstance(spec, dict), "EngineConfig parses speculative_config"
    return WorkerConfig(
        model=model_path,
        dtype=config.resolved_dtype(device),
        device=device,
        block_size=config.resolved_block_size(device),
        attention_backend=config.attention_backend,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        pipeline_layer_partition=config.resolved_layer_partition(),
        num_gpu_blocks=config.num_gpu_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes
        if config.kv_cache_memory_bytes or config.num_gpu_blocks or device == "cuda"
        else ENGINE_CPU_KV_BYTES,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
        max_num_batched_tokens=step_tokens,
        enable_cuda_graph=device == "cuda" and not config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        state_snapshots=state_snapshots(config, is_recurrent(model_path)),
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        speculative_model=(model_path if spec.method in OWN_HEAD_METHODS else spec.model)
        if spec else None,
        speculative_method=spec.method if spec else "draft_model",
        speculative_quantization=spec.quantization if spec else None,
        num_threads=config.num_threads,
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
        max_loaded_loras=config.resolved_max_loaded_loras() if config.enable_lora else 0,
        kv_cache_dtype=config.kv_cache_dtype,
        calculate_kv_scales=config.calculate_kv_scales,
        quantization=config.quantization,
        batch_invariant=config.batch_invariant,
        enable_expert_parallel=config.enable_expert_parallel,
        expert_placement_strategy=config.expert_placement_strategy,
        hybrid_kv_cache=not config.disable_hybrid_kv_cache_manager,
        enable_images=config.image_limit > 0,
        enable_videos=config.video_limit > 0,
        logits_processors=tuple(config.logits_processors or ()),
        hf_overrides=config.hf_overrides,
        extra=dict(config.worker_extra),
    )
