"""Sleep, wake and new weights for one rank: what an RLHF loop asks of its generator.

A training loop that shares devices with the engine puts it to sleep while it
trains, then hands it new weights and wakes it (vLLM's sleep mode and SGLang's
``update_weights_from_disk``):

- level 1 drops the KV pool shard (its blocks are recomputed, not saved) and, on
  a GPU, moves the weights to host memory; waking copies them back;
- level 2 drops the weights too; waking loads them again from the model path
  (the one last given to ``update_weights``, else the configured one);
- ``update_weights`` builds the model from another checkpoint of the same
  architecture (every ``ModelConfig`` field but the stored dtype must match) and
  swaps it in only once complete, so a bad file leaves the old weights serving.
  Asleep at level 2 there is no old copy, so the swap costs no second copy.

A DeepSeek model drafting with its own multi-token-prediction layer
(``deepseek_mtp``) holds that layer as a head beside the model: new weights bring
their own (a checkpoint without one is refused before anything changes), and level 2
drops it with the model and loads it again on waking.

The engine keeps the block accounting: it sleeps only when idle, forgets its
prefix cache (the blocks' contents are gone or stale), and re-adds LoRA
adapters after the model is rebuilt. fp8 KV scales calibrated at start-up are
carried over to a rebuilt model (new weights keep the old scales).
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.worker.config import ModelConfig
from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.loaders.hf import checkpoint_names
from pagedserve.worker.models.mtp import MTPHead, mtp_problem
from pagedserve.worker.models.qwen3_next_mtp import Qwen3NextMTPHead

if TYPE_CHECKING:
    from pagedserve.worker.worker import Worker


@dataclass(frozen=True)
class SleepState:
    """What waking needs: the level, the pool to allocate again, and (level 2) the fp8
    KV scales the dropped model had."""

    level: int
    num_blocks: int
    num_cpu_blocks: int
    kv_scales: list[tuple[float, float]] | None = None
    mtp_head: bool = False  # level 2 dropped the model's own MTP head; waking loads it


def kv_scales(model: torch.nn.Module) -> list[tuple[float, float]] | None:
    """Each attention layer's calibrated fp8 ``(k_scale, v_scale)``, or None without."""
    layers = list(model.attention_layers())
    if not layers or layers[0].k_scale is None:
        return None
    return [(float(a.k_scale), float(a.v_scale)) for a in layers]


def set_kv_scales(model: torch.nn.Module, scales: list[tuple[float, float]] | None,
                  device: torch.device) -> None:
    """Give a rebuilt model the scales calibrated at start-up (same text, same scales:
    an fp8 pool keeps its meaning across sleep and weight updates)."""
    if scales is None:
        return
    for attn, (k, v) in zip(model.attention_layers(), scales, strict=True):
        attn.use_kv_scales(device)
        attn.k_scale.fill_(k)
        attn.v_scale.fill_(v)


def check_same_architecture(current: ModelConfig, new: ModelConfig) -> None:
    """``ValueError`` naming the first config field where ``new`` differs."""
    for f in dataclasses.fields(current):
        if f.name in ("dtype", "prequant"):  # how the file stores weights, not the model
            continue
        a, b = getattr(current, f.name), getattr(new, f.name)
        if a != b:
            raise ValueError(f"new weights have {f.name}={b!r}, the engine runs {a!r}: "
                             "update_weights takes a checkpoint of the same architecture")


def sleep(worker: Worker, level: int) -> None:
    """Free this rank's KV shard (and at level 2 its weights; at level 1 on a GPU, move
    them to host memory)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    if worker.sleep_state is not None:
        raise ValueError(f"already asleep (level {worker.sleep_state.level})")
    kv = worker.kv_cache
    if kv is None:
        raise RuntimeError("init_kv_cache must be called before sleep")
    scales = kv_scales(worker.model) if level == 2 else None
    mtp = level == 2 and _drafts_with_mtp(worker)
    worker.sleep_state = SleepState(level, kv.num_blocks, kv.num_cpu_blocks, scales, mtp)
    worker.runner = worker.kv_cache = None
    if level == 2:
        worker.model = worker.lora = None
        if mtp:
            worker.draft = None
    elif worker.device.type == "cuda":  # pragma: no cover - CUDA only
        worker.model.to("cpu")
    _release(worker.device)


def wake_up(worker: Worker) -> None:
    """Weights back (loaded again after level 2), a fresh KV shard, a new runner."""
    state = worker.sleep_state
    if state is None:
        raise ValueError("not asleep")
    if worker.model is None:
        assert worker.resolved is not None and worker.model_config is not None
        worker.build_model(worker.resolved, worker.model_config)
        set_kv_scales(worker.model, state.kv_scales, worker.device)
        if state.mtp_head:
            _load_mtp(worker)
    elif worker.device.type == "cuda":  # pragma: no cover - CUDA only
        worker.model.to(worker.device)
    worker.init_kv_cache(state.num_blocks, state.num_cpu_blocks, calibrate=False)
    worker.sleep_state = None


def update_weights(worker: Worker, model: str) -> None:
    """Serve ``model``'s weights (a local HF directory or GGUF file) from now on."""
    resolved = resolve_model(model)
    config = ModelConfig.from_pretrained(resolved.path)
    assert worker.model_config is not None
    check_same_architecture(worker.model_config, config)
    # The new file may be quantised another way (a GPTQ file after a dense one).
    new_config = dataclasses.replace(worker.model_config, prequant=config.prequant)
    mtp = _drafts_with_mtp(worker) or (worker.sleep_state is not None
                                       and worker.sleep_state.mtp_head)
    if mtp and (why := mtp_problem(config, checkpoint_names(resolved.path))):
        raise ValueError(f"speculative_config.method "
                         f"{worker.config.speculative_method!r}: the new weights: {why}")
    if worker.model is None:  # asleep at level 2: waking loads from the new path
        worker.resolved, worker.model_config = resolved, new_config
        return
    scales = kv_scales(worker.model)
    worker.runner = None  # its CUDA graphs hold the old weights
    worker.build_model(resolved, new_config)
    set_kv_scales(worker.model, scales, worker.device)
    worker.resolved, worker.model_config = resolved, new_config
    if mtp:
        _load_mtp(worker)
    if worker.sleep_state is not None:  # asleep at level 1: keep the weights off the GPU
        if worker.device.type == "cuda":  # pragma: no cover - CUDA only
            worker.model.to("cpu")
    elif worker.kv_cache is not None:
        worker.build_runner(calibrate=False)
    _release(worker.device)


def _drafts_with_mtp(worker: Worker) -> bool:
    """Whether this rank holds the model's own MTP layer as its drafter."""
    return worker.draft is not None and isinstance(worker.draft.model,
                                                   (MTPHead, Qwen3NextMTPHead))


def _load_mtp(worker: Worker) -> None:
    """The served checkpoint's MTP layer as this rank's drafter, beside the model just
    built (it shares that model's embedding where the rank holds it whole)."""
    from pagedserve.worker.drafting import load_drafter

    assert worker.model is not None and worker.model_config is not None
    assert worker.resolved is not None and worker.ctx is not None
    worker.draft = load_drafter(worker.config, worker.model, worker.model_config,
                                worker.resolved.path, worker.ctx, worker.dtype, worker.device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":  # pragma: no cover - CUDA only
        torch.cuda.empty_cache()
