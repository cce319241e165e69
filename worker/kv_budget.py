"""What sizes a rank's KV pool: the CPU default budget, and the profiling step.

On CUDA the pool gets what ``gpu_memory_utilization`` leaves after the largest
step the engine may plan (:func:`profile_plan`), as in vLLM's profiling run; on
CPU an explicit byte or block budget, else :data:`CPU_DEFAULT_KV_BYTES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.worker.worker import Worker

CPU_DEFAULT_KV_BYTES = 2 << 30


def profile_plan(num_tokens: int, max_num_seqs: int, block_size: int,
                 pooling: bool = False) -> tuple[SchedulerOutput, int]:
    """A step of ``num_tokens`` prompt tokens over as many sequences as may run at once.

    Every sequence samples with top-k/top-p, so the logits rows and the
    sampler's sort are as large as a real step's; with ``pooling`` (a headless
    model, which only pools) every sequence pools its last state instead. Returns
    the plan and the number of blocks its sequences use (numbered from 0).
    """
    k = max(1, min(max_num_seqs, num_tokens))
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)
    scheduled, next_block = [], 0
    for i in range(k):
        n = num_tokens // k + (i < num_tokens % k)
        need = -(-n // block_size)
        rid = f"profile-{i}"
        row = ScheduledRequest(rid, [0] * n, 0, list(range(next_block, next_block + need)),
                               [] if pooling else [rid], {} if pooling else {rid: params})
        if pooling:
            row.pooling, row.pool_final = "last", True
        scheduled.append(row)
        next_block += need
    return SchedulerOutput(step_id=-1, scheduled=scheduled), next_block


def num_device_blocks(worker: Worker) -> int:
    """Device KV blocks ``worker`` can hold: its explicit count, else its byte budget
    (``kv_cache_memory_bytes``, CUDA profiling, or the CPU default) over its bytes per
    block; a budget below one block is an error, not an empty pool. A model that
    caches nothing gets enough blocks for ``max_num_seqs`` prompts of its longest
    length: the scheduler's block accounting then limits nothing else."""
    cfg = worker.config
    if cfg.num_gpu_blocks is not None:
        return cfg.num_gpu_blocks
    per_block = worker.block_bytes()
    if per_block == 0:  # no KV cache (an encoder): as many blocks as the batch can fill
        assert worker.model_config is not None
        per_seq = -(-worker.model_config.max_model_len // cfg.block_size)
        return cfg.max_num_seqs * per_seq
    mamba = worker.model_config.mamba if worker.model_config is not None else None
    states = 0  # (a hybrid's Mamba slots, ``max_num_seqs`` of them, each with the
    # states after its draft tokens, and its prefix cache's snapshots)
    if mamba is not None:
        elem = torch.empty((), dtype=worker.dtype).element_size()
        slots = cfg.max_num_seqs * (1 + cfg.num_speculative_tokens) + cfg.state_snapshots
        states = slots * mamba.state_bytes(elem, cfg.tensor_parallel_size)
        if worker.model is not None and hasattr(worker.model, "mamba_mixers"):
            # (a pipeline stage holds its own layers' states only)
            states = states * len(worker.model.mamba_mixers()) // max(len(mamba.layers), 1)
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes - states
    elif worker.device.type == "cuda":
        budget = cuda_kv_budget(worker)  # (its profiled peak holds the slots)
    else:
        budget = CPU_DEFAULT_KV_BYTES - states
    if budget < per_block and states:
        raise RuntimeError(f"KV budget left after the Mamba state of max_num_seqs "
                           f"({cfg.max_num_seqs}) sequences ({states} bytes) is below one "
                           f"block ({per_block} bytes): lower max_num_seqs or raise "
                           "kv_cache_memory_bytes")
    if budget < per_block:
        raise RuntimeError(f"KV budget of {budget} bytes is below one block "
                           f"({per_block} bytes)")
    return int(budget // per_block)


def cuda_kv_budget(worker: Worker) -> int:  # pragma: no cover - CUDA only
    """``total * gpu_memory_utilization`` minus what a max-size forward peaks at (the
    worker's ``profile_forward``, its draft model's forwards included), what is not
    torch's, and room for the LoRA adapters the config may load."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(worker.device)
    worker.profile_forward()
    torch.cuda.synchronize(worker.device)
    peak = torch.cuda.max_memory_allocated(worker.device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(worker.device)
    non_torch = total - free - torch.cuda.memory_reserved(worker.device)
    loras = worker.lora.adapter_bytes() * worker.config.max_loaded_loras if worker.lora else 0
    return int(total * worker.config.gpu_memory_utilization - peak - max(non_torch, 0)
               - loras)
