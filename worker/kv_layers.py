"""Which layers hold KV, and in which cache group: every layer of an attention model,
only the attention layers of a hybrid one (``mamba_config``): its Mamba layers keep
a state per sequence (``mamba_state``) instead, and Nemotron-H's MLP-only layers
keep nothing. Groups (``scheduler.kv_groups``) are planned over
the KV layers only, so a Granite 4.0-H with four attention layers in forty pays for
four layers' KV a block, not forty."""

from __future__ import annotations

from pagedserve.scheduler.kv_groups import KVGroupLayout, plan_kv_groups
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.pipeline import PipelineStage


def kv_layers(mc: ModelConfig) -> tuple[int, ...]:
    """The model's layers that attend through the paged KV cache, in order."""
    return mc.mamba.attention if mc.mamba is not None else tuple(range(mc.num_layers))


def kv_layout_of(mc: ModelConfig, hybrid: bool) -> KVGroupLayout:
    """The model's KV cache groups over its KV layers (numbered 0.. among them): by
    layer window when ``hybrid``, else one."""
    return plan_kv_groups([mc.layer_window(i) for i in kv_layers(mc)], hybrid)


def stage_kv_ids(mc: ModelConfig, stage: PipelineStage) -> list[int]:
    """The KV-layer numbers (``kv_layout_of``'s) of a pipeline stage's layers, in order."""
    return [j for j, layer in enumerate(kv_layers(mc)) if stage.start <= layer < stage.end]
