"""What ``LLMEngine`` settles before and after its ranks start: the checks that fail a
bad configuration on the driver (a draft that cannot draft, stages the model cannot
fill) and the scheduler sized from what the ranks report."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.processor_options import check_processor_kwargs
from pagedserve.cluster.recurrent_engine import state_snapshots
from pagedserve.cluster.worker_settings import worker_config_for
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.draft_model import check_draft
from pagedserve.worker.eagle_runner import check_eagle
from pagedserve.worker.layers.expert_placement import expert_parallel_problem
from pagedserve.worker.loaders.hf import checkpoint_names
from pagedserve.worker.models.eagle import EAGLE_METHODS
from pagedserve.worker.models.mtp import MTP_METHODS, mtp_problem
from pagedserve.worker.pipeline import check_stages_fit
from pagedserve.worker.worker_config import WorkerConfig


def checked_worker_config(config: EngineConfig, model_path: str, device: str) -> WorkerConfig:
    """Every rank's settings, after the checks that need no rank: the draft model is
    resolved to a local path and fits the target, the pipeline's stages hold layers,
    expert parallelism has an expert for every rank, the multimodal processor takes
    its options, the model's config reads (the engine runs this before loading the
    tokenizer, whose loader may reject a bad field without naming it)."""
    wcfg = worker_config_for(config, model_path, device)
    has_config = (Path(model_path) / "config.json").is_file()
    mc = ModelConfig.from_pretrained(model_path, config.hf_overrides) if has_config else None
    if wcfg.speculative_model is not None and wcfg.speculative_method in EAGLE_METHODS:
        wcfg = replace(wcfg, speculative_model=check_eagle(
            wcfg.speculative_model, wcfg.speculative_method, model_path))
        if wcfg.speculative_method == "eagle3" and config.pipeline_parallel_size > 1:
            raise ValueError("speculative_config.method 'eagle3' reads layers of every "
                             "pipeline stage; run it with pipeline_parallel_size 1")
    elif wcfg.speculative_method in MTP_METHODS:
        why = mtp_problem(mc or ModelConfig.from_pretrained(model_path, config.hf_overrides),
                          checkpoint_names(model_path))
        if why is not None:
            raise ValueError(f"speculative_config.method {wcfg.speculative_method!r}: {why}")
    elif wcfg.speculative_model is not None:
        wcfg = replace(wcfg, speculative_model=check_draft(
            wcfg.speculative_model, model_path, wcfg.hybrid_kv_cache))
    if config.mm_processor_kwargs:  # a key the model's processor does not take, by name
        model_type = json.loads((Path(model_path) / "config.json").read_text()).get(
            "model_type") if has_config else None
        check_processor_kwargs(config.mm_processor_kwargs, model_type)
    if config.pipeline_parallel_size > 1:
        check_stages_fit(model_path, config.pipeline_parallel_size,
                         config.resolved_layer_partition())
    if mc is not None and mc.mla is not None:
        wcfg = _latent_attention_config(wcfg)
    if wcfg.enable_expert_parallel and mc is not None and mc.moe is not None and (
            why := expert_parallel_problem(mc.moe.num_experts, config.tensor_parallel_size)):
        raise ValueError(why)
    return wcfg


def _latent_attention_config(wcfg: WorkerConfig) -> WorkerConfig:
    """Refuse what a DeepSeek (MLA) model cannot serve yet, naming the option, and keep
    flash-attn (heads of at most 256; the latent is 576 wide) off the automatic choice."""
    refused = {"enable_lora": wcfg.max_lora_rank > 0,
               "calculate_kv_scales": wcfg.calculate_kv_scales,  # (K and V share the cache)
               "batch_invariant": wcfg.batch_invariant,
               "speculative_config.method": wcfg.speculative_model is not None
               and wcfg.speculative_method in EAGLE_METHODS}
    for option, on in refused.items():
        if on:
            raise ValueError(f"{option} is not supported for multi-head latent attention "
                             "models (DeepSeek-V2 / V3)")
    if wcfg.attention_backend == "flash":
        raise ValueError("attention_backend 'flash' takes heads of at most 256 numbers; a "
                         "DeepSeek model's latent cache is wider: use 'triton'")
    if wcfg.attention_backend is None and wcfg.device.startswith("cuda"):
        return replace(wcfg, attention_backend="triton")
    return wcfg


def build_scheduler(config: EngineConfig, info: dict[str, Any], model_id: str, max_len: int,
                    block_size: int, num_gpu_blocks: int, cpu_blocks: tuple[int, int],
                    max_concurrent_batches: int) -> Scheduler:
    """The scheduler over the pool the ranks allocated (``cpu_blocks``: swap, offload)
    and the model facts they reported (``info``: windows, LongRoPE's switch)."""
    num_swap, num_offload = cpu_blocks
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs)
            if config.enable_chunked_prefill else max(config.max_num_batched_tokens, max_len),
            max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
            max_loras=config.max_loras if config.enable_lora else 0,
            policy=config.scheduling_policy, priority_aging_s=config.priority_aging_s,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_concurrent_batches=max_concurrent_batches,
            output_history=bool(config.logits_processors),
        ),
        CacheConfig(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            num_cpu_blocks=num_swap + num_offload,
            enable_prefix_caching=config.enable_prefix_caching,
            model_id=model_id,
            enable_kv_offload=num_offload > 0, sliding_window=info.get("kv_sliding_window"),
            long_rope_from=info.get("long_rope_from", 0),
            kv_group_windows=tuple(info.get("kv_group_windows") or ()),
            state_snapshots=state_snapshots(config, bool(info.get("recurrent_state"))),
        ),
        config.speculative_config,
    )
