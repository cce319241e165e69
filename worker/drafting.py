"""Which drafter a rank holds for speculative decoding: a draft model
(``draft_model``) or an EAGLE head (``eagle_runner``), loaded beside the target on the
rank that samples, and the runner that drives it over a KV pool of its own."""

from __future__ import annotations

import torch

from pagedserve.kernels import AttentionBackend
from pagedserve.worker.config import ModelConfig, WorkerConfig
from pagedserve.worker.draft_model import DraftModel, DraftRunner, load_draft_model
from pagedserve.worker.eagle_runner import EagleRunner, load_eagle_head
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.models.eagle import EAGLE_METHODS, EagleHead
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.parallel import ParallelContext


def load_drafter(config: WorkerConfig, target: LlamaForCausalLM, target_config: ModelConfig,
                 target_path: str, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device) -> DraftModel:
    """The draft model or EAGLE head ``config.speculative_model`` names."""
    assert config.speculative_model is not None
    if config.speculative_method in EAGLE_METHODS:
        return load_eagle_head(config.speculative_model, config.speculative_method, target,
                               target_path, ctx, dtype, device, config.attention_backend,
                               config.cpu_packed_weights)
    return load_draft_model(config.speculative_model, dtype, device, config.attention_backend,
                            config.speculative_quantization, target_config,
                            config.cpu_packed_weights, config.hybrid_kv_cache)


def drafter_runner(draft: DraftModel, target: LlamaForCausalLM, target_kv: KVCache,
                   config: WorkerConfig, dtype: torch.dtype, device: torch.device,
                   backend: AttentionBackend) -> DraftRunner:
    """``draft`` over a KV pool of its own with the target's block ids (and CPU blocks)."""
    mc = draft.config
    kv = KVCache(mc.num_layers, target_kv.num_blocks, config.block_size, mc.num_kv_heads,
                 mc.head_dim, dtype, device, backend, target_kv.num_cpu_blocks)
    if isinstance(draft.model, EagleHead):
        return EagleRunner(draft, kv, device, config.num_speculative_tokens, target)
    return DraftRunner(draft, kv, device, config.num_speculative_tokens,
                       target.config.vocab_size)
