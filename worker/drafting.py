"""Which drafter a rank holds for speculative decoding: a draft model
(``draft_model``), an EAGLE head (``eagle_runner``) or a DeepSeek-V3 target's own MTP
layer (``models.mtp``, run as an EAGLE head is), loaded beside the target on the rank
that samples, and the runner that drives it over a KV pool of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from pagedserve.kernels import AttentionBackend, get_backend
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.draft_model import DraftModel, DraftRunner, load_draft_model
from pagedserve.worker.eagle_runner import EagleRunner, load_eagle_head
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.layers.packed import can_pack, pack_model
from pagedserve.worker.loaders import iter_safetensors
from pagedserve.worker.loaders.hf import checkpoint_names
from pagedserve.worker.loaders.prequant import dequantized_weights
from pagedserve.worker.models.eagle import EAGLE_METHODS, EagleHead
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.mtp import MTP_METHODS, MTPHead, mtp_problem
from pagedserve.worker.models.qwen3_next_mtp import (
    PREFIX,
    QWEN3_NEXT_TYPES,
    Qwen3NextMTPHead,
    routed_mtp,
)
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.worker_config import WorkerConfig

# Heads that draft from the target's hidden states (``EagleRunner``), reattached to
# a target built anew (woken from sleep, new weights).
HEAD_TYPES = (EagleHead, MTPHead, Qwen3NextMTPHead)


def load_drafter(config: WorkerConfig, target: LlamaForCausalLM, target_config: ModelConfig,
                 target_path: str, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device) -> DraftModel:
    """The draft model or EAGLE head ``config.speculative_model`` names."""
    assert config.speculative_model is not None
    if config.speculative_method in MTP_METHODS:
        return load_mtp_head(target, target_config, target_path, ctx, dtype, device,
                             config.attention_backend, config.cpu_packed_weights)
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
                 mc.head_dim, dtype, device, backend, target_kv.num_cpu_blocks,
                 shared_kv=mc.mla is not None)
    if isinstance(draft.model, HEAD_TYPES):
        return EagleRunner(draft, kv, device, config.num_speculative_tokens, target)
    return DraftRunner(draft, kv, device, config.num_speculative_tokens,
                       target.config.vocab_size)


def load_mtp_head(target: LlamaForCausalLM, cfg: ModelConfig, target_path: str,
                  ctx: ParallelContext, dtype: torch.dtype, device: torch.device,
                  attention_backend: str | None, packed_weights: bool = True) -> DraftModel:
    """The target checkpoint's first MTP layer as a head on this rank (the last
    stage's rank 0), sharing the target's embedding (and for Qwen3-Next / Qwen3.5, its
    LM head) where it holds them whole."""
    names = checkpoint_names(target_path)
    if (why := mtp_problem(cfg, names)) is not None:
        raise ValueError(f"speculative_config.method (the model's MTP layer): {why}")
    whole = ctx.world_size == 1 and target.embed_tokens is not None
    backend = get_backend(attention_backend, device, kv_cache_dtype=dtype, model_dtype=dtype)
    head: MTPHead | Qwen3NextMTPHead
    if cfg.model_type in QWEN3_NEXT_TYPES:
        whole = whole and target.lm_head is not None
        head = Qwen3NextMTPHead(cfg, backend, dtype, device,
                                target.embed_tokens if whole else None,
                                target.lm_head if whole else None, routed_mtp(names))
    else:
        head = MTPHead(cfg, backend, dtype, device, target.embed_tokens if whole else None)
    weights = iter_safetensors(target_path)
    if cfg.prequant is not None:
        weights = dequantized_weights(weights, cfg.prequant, names, _mtp_or_embedding(cfg))
    head.load_weights(weights)
    head.eval()
    if packed_weights and can_pack(device, dtype):
        pack_model(head.layer)
        if isinstance(head, MTPHead) or head.own_head:
            pack_model(head.lm_head)
    return DraftModel(head, replace(cfg, num_layers=1), f"{target_path} (MTP layer)")


def _mtp_or_embedding(cfg: ModelConfig) -> Callable[[str], bool]:
    """The tensors an MTP head reads: its layer's, the embedding's and the head's."""
    if cfg.model_type in QWEN3_NEXT_TYPES:
        return lambda name: name.startswith(PREFIX) or name.endswith(
            ("embed_tokens.weight", "lm_head.weight"))
    prefix = f"model.layers.{cfg.num_layers}."
    return lambda name: name.startswith(prefix) or name == "model.embed_tokens.weight"
