"""What an engine changes to serve an encoder: BERT, RoBERTa, XLM-R, ModernBERT
(``worker.encoder_config``).

An encoder attends both ways: a token's state depends on the whole prompt, so
a prompt runs whole, in one step (no chunked prefill), and no prefix of it can
be reused (no prefix caching) — the choices vLLM makes for encoder-only models
too. It keeps no KV cache (``worker.models.bert``), so there is nothing to swap
or offload: preemption recomputes, which for a one-step request means running
it again later. Options that need a decoder are refused by name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from pagedserve.cluster.config import EngineConfig
from pagedserve.worker.encoder_config import ENCODER_MODEL_TYPES

logger = logging.getLogger(__name__)


def model_type_at(model_path: str) -> str | None:
    """The ``model_type`` of the checkpoint in ``model_path``; None when it has no
    readable ``config.json`` (the model config's own reader names what is wrong)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_encoder(model_path: str) -> bool:
    """Whether the checkpoint in ``model_path`` is an encoder (``ENCODER_MODEL_TYPES``)."""
    return model_type_at(model_path) in ENCODER_MODEL_TYPES


def encoder_engine_config(config: EngineConfig, model_path: str) -> EngineConfig:
    """``config`` as an encoder runs it (unchanged for any other model); a
    ``ValueError`` names an option an encoder cannot honour."""
    if not is_encoder(model_path):
        return config
    refused = {
        "enable_lora": config.enable_lora,
        "speculative_config": config.speculative_config is not None,
        "pipeline_parallel_size > 1": config.pipeline_parallel_size > 1,
        "enable_prompt_embeds": config.enable_prompt_embeds,
        "long_prefill_token_threshold": config.long_prefill_token_threshold > 0,
        "kv_offloading_size": config.offloads_kv(),
        "logits_processors": bool(config.logits_processors),
    }
    for option, on in refused.items():
        if on:
            raise ValueError(f"{option} is not supported for encoder models (BERT, RoBERTa, "
                             "XLM-RoBERTa, ModernBERT): they embed and classify whole "
                             "prompts")
    if config.enable_prefix_caching or config.enable_chunked_prefill:
        logger.info("encoder model: prefix caching and chunked prefill are off (each "
                    "prompt runs whole, attending both ways)")
    return replace(config, enable_prefix_caching=False, enable_chunked_prefill=False,
                   preemption_mode="recompute", num_cpu_blocks=0, num_offload_blocks=0)
