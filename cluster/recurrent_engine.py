"""What an engine changes to serve a model with recurrent layers: Mamba-2 (Granite
4.0-H, Nemotron-H: ``worker.mamba_config``), Mamba-1 (Jamba: ``worker.mamba1_config``;
the attention-free Mamba models: ``worker.mamba_lm_config``), gated DeltaNet
(Qwen3-Next: ``worker.deltanet_config``) or short convolutions (LFM2).

A Mamba (or DeltaNet) layer folds a sequence's whole past into one state per sequence
(``worker.mamba_state``), which no KV block holds. So a prompt whose leading blocks
sit in the prefix cache still needs its state there: prefix caching is off unless
``mamba_cache_mode`` is "align" (vLLM's name), which keeps snapshots of states at
block boundaries (``scheduler.state_cache``: each sequence's prompt's and its
latest, ``2 * max_num_seqs`` of them in all) and resumes a hit only where one is
held. The CPU offload tier and shipping a prompt's KV to another replica stay off.
Speculative decoding by n-gram, suffix, a (non-recurrent) draft model or
Qwen3-Next's own MTP module works: each slot keeps its states after each guess, and
a step that rejected some starts its next from the one after the last kept
(``worker.mamba_state``). EAGLE heads are not built for these models; beam search
would need a state copied per beam: refused by name. LoRA adapters on the attention
and MLP projections serve where those are Llama's (``LORA_MODEL_TYPES``); the mixers
take none, and other families refuse ``enable_lora`` by name. Chunked
prefill, swap and recompute preemption, ``n > 1``, tensor parallelism
(``mamba_n_groups`` divisible by it) and pipeline stages (each keeps its own
layers' states, as every stage sees every plan of its sequences in order) work.
Every sequence the batch may hold has its state (and its states after guesses) made
up front, out of the KV budget: on CPU ``max_num_seqs`` is lowered to what half the
budget holds.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pagedserve.cluster.config import ENGINE_CPU_KV_BYTES, EngineConfig
from pagedserve.cluster.encoder_engine import model_type_at
from pagedserve.scheduler.spec_decode import MODEL_METHODS
from pagedserve.worker.mamba_config import HYBRID_MODEL_TYPES

logger = logging.getLogger(__name__)

_WHY = ("for recurrent models (Mamba, Jamba, Granite 4.0-H, Nemotron-H, Qwen3-Next...): "
        "their per-sequence state is not paged")


# Recurrent models whose attention and MLP projections take adapters as Llama's do
# (checked against PEFT; Falcon-H1's scaled by the multipliers folded into them,
# Qwen3-Next's q_proj split into query and gate, Nemotron-H's blocks' renamed); the
# Mamba models have neither.
LORA_MODEL_TYPES = ("jamba", "bamba", "granitemoehybrid", "lfm2", "lfm2_moe", "falcon_h1",
                    "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text",
                    "qwen3_5_moe_text", "nemotron_h")


def is_recurrent(model_path: str) -> bool:
    """Whether the checkpoint in ``model_path`` has recurrent layers
    (``HYBRID_MODEL_TYPES``)."""
    return model_type_at(model_path) in HYBRID_MODEL_TYPES


def recurrent_engine_config(config: EngineConfig, model_path: str) -> EngineConfig:
    """``config`` as a hybrid Mamba model runs it (unchanged for any other model); a
    ``ValueError`` names an option it cannot honour."""
    model_type = model_type_at(model_path)
    if model_type not in HYBRID_MODEL_TYPES:
        return config
    method = config.speculative_config.method if config.speculative_config else None
    refused = {
        f"speculative_config.method {method!r}": method in MODEL_METHODS
        and method != "draft_model",
        "kv_offloading_size": config.offloads_kv(),
        "batch_invariant": config.batch_invariant,
    }
    for option, on in refused.items():
        if on:
            raise ValueError(f"{option} is not supported {_WHY}")
    if config.enable_lora and model_type not in LORA_MODEL_TYPES:
        raise ValueError(f"enable_lora is not supported for {model_type!r}: among recurrent "
                         f"models LoRA serves the attention and MLP projections of "
                         f"{', '.join(LORA_MODEL_TYPES)} (the mixers take no adapter)")
    caching = config.enable_prefix_caching and config.mamba_cache_mode == "align"
    if config.enable_prefix_caching and not caching:
        logger.info("hybrid Mamba / DeltaNet model: prefix caching is off (a cached "
                    "prefix's KV holds no recurrent state; mamba_cache_mode='align' keeps "
                    "states at block boundaries)")
    config = replace(config, enable_prefix_caching=caching)
    return replace(config, max_num_seqs=_seqs_within_budget(config, model_path))


def state_snapshots(config: EngineConfig, recurrent: bool) -> int:
    """How many state snapshots a recurrent model's prefix cache keeps (its workers'
    room, the scheduler's directory): two per sequence the batch may hold (each keeps
    its prompt's and its latest; with one, a batch's new snapshots evicted those of
    the conversations it had yet to admit), when ``recurrent_engine_config`` left
    prefix caching on; else 0."""
    return 2 * config.max_num_seqs if recurrent and config.enable_prefix_caching else 0


def _seqs_within_budget(config: EngineConfig, model_path: str) -> int:
    """``max_num_seqs``, lowered on CPU so that many sequences' Mamba state (on the
    pipeline stage that holds the most of it) takes at most half the KV budget
    (Granite 4.0-H-tiny keeps 57 MB a sequence in fp32; 256 of them would be 14.6
    GB). A CUDA pool is sized after a profile that holds the slots, and an explicit
    block count leaves the state uncounted: unchanged."""
    device = config.resolved_device()
    if device == "cuda" or (config.num_gpu_blocks and not config.kv_cache_memory_bytes):
        return config.max_num_seqs
    import torch

    from pagedserve.worker.config import ModelConfig
    from pagedserve.worker.pipeline import layer_partition

    mc = ModelConfig.from_pretrained(model_path, config.hf_overrides)
    mamba = mc.mamba
    assert mamba is not None
    elem = torch.empty((), dtype=getattr(torch, config.resolved_dtype(device))).element_size()
    per_seq = mamba.state_bytes(elem, config.tensor_parallel_size)
    # (a pipeline stage keeps its own layers' states: the fullest stage's share)
    stages = layer_partition(mc.num_layers, config.pipeline_parallel_size,
                             config.resolved_layer_partition())
    held = max(sum(start <= i < end for i in mamba.layers) for start, end in stages)
    per_seq = per_seq * held // max(len(mamba.layers), 1)
    spec = config.speculative_config
    # (its states after each guess, and two snapshots' room with prefix caching)
    per_seq *= (1 + (spec.num_speculative_tokens if spec else 0)
                + (2 if config.enable_prefix_caching else 0))
    budget = config.kv_cache_memory_bytes or ENGINE_CPU_KV_BYTES
    fits = max(1, budget // 2 // per_seq)
    if fits >= config.max_num_seqs:
        return config.max_num_seqs
    logger.warning("hybrid Mamba model: max_num_seqs lowered from %d to %d, whose Mamba "
                   "state (%.1f MiB a sequence) fits half the KV budget (%.0f MiB; "
                   "kv_cache_memory_bytes raises it)", config.max_num_seqs, fits,
                   per_seq / 2**20, budget / 2**20)
    return fits


def check_recurrent_request(beam: bool, export_kv: bool) -> None:
    """Refuse, by name, what a request to a hybrid Mamba model cannot have."""
    if beam:
        raise ValueError(f"beam search is not supported {_WHY}")
    if export_kv:
        raise ValueError(f"shipping a prompt's KV (disaggregated prefill) is not supported "
                         f"{_WHY}")
