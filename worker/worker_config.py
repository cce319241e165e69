"""``WorkerConfig``: what one tensor-parallel rank needs to start.

A plain picklable dataclass, so the engine can ship it to Ray actors; every bad
value fails at construction, naming the field, before a rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kernels.kv_quant import check_kv_cache_dtype, resolve_kv_cache_dtype
from pagedserve.worker.layers.expert_placement import check_placement
from pagedserve.worker.layers.quant import check_quantization

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("float32", "bf16", ...) or torch.dtype to a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[key]



@dataclass
class WorkerConfig:
    """What one tensor-parallel rank needs to start.

    ``dist_init_method`` may be left None at construction and passed to
    ``Worker.init_device`` later, because rank 0's address and port are only
    known once its actor is running.

    ``cpu_packed_weights`` keeps fp32 CPU projections in oneDNN's blocked
    layout (see ``layers.packed``), 15-25% faster than plain ``F.linear``.

    KV sizing: on CPU give ``num_gpu_blocks`` or ``kv_cache_memory_bytes``
    (there is nothing to profile against); on CUDA, when neither is given,
    ``gpu_memory_utilization`` of the device is used after a profiling forward,
    whose logits rows include ``num_speculative_tokens`` per sequence.

    ``speculative_model`` is a draft model (``worker.draft_model``), or for
    ``speculative_method`` "eagle" / "eagle3" an EAGLE head (``models.eagle``), held
    by the rank that samples, a draft's weights quantised online by
    ``speculative_quantization`` when set; its KV pool has the target's block count,
    so its bytes count in that rank's bytes per block.

    ``kv_cache_dtype`` (``kernels.kv_quant``) stores the KV pool narrower than
    ``dtype``: "auto" is the model dtype; fp16/bf16 halve an fp32 pool's bytes
    per block, fp8 quarters them, so a byte budget holds 2x / 4x the blocks.
    ``calculate_kv_scales`` gives an fp8 pool per-layer scales set by the first step
    after ``init_kv_cache`` (the engine's calibration text; ``layers.attention``);
    without it fp8 stores K/V as they are.

    ``quantization`` "int8" keeps every projection as 8-bit codes with a scale per
    32 inputs and runs it on int8 activations; "int4" as 4-bit codes with a scale and
    a minimum per 32 (``layers.quant``; on CUDA int4 only, ``kernels.triton_w4a16``).

    ``batch_invariant`` pads GEMM rows and runs every attention row on the native
    per-row kernel, so a row's logits do not depend on the batch (``batch_invariant``).

    ``enable_expert_parallel`` gives each rank of a TP group whole routed experts, a
    share placed by ``expert_placement_strategy`` (``layers.expert_placement``).

    ``hybrid_kv_cache`` gives a model that mixes full and sliding-window layers one
    block table per group of layers of one kind (``scheduler.kv_groups``), so sliding
    layers hold only their window; off, every layer keeps every block.

    ``enable_images`` builds a multimodal file's image encoder (Gemma 3's SigLIP tower
    and projector); off, the file serves text only and the tower is never read, unless
    ``enable_videos`` and the file takes videos (Qwen2-VL: ``vision_encoded``).

    ``max_lora_rank`` > 0 enables LoRA adapters up to that rank
    (``layers.lora``); 0 serves the base model only. CUDA profiling keeps room
    for ``max_loaded_loras`` adapters of that rank out of the KV pool.
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    rank: int = 0
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] | None = None  # layers per stage (None: even)
    pp_rank: int = 0
    dist_init_method: str | None = None
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_cpu_blocks: int = 0
    seed: int = 0
    max_num_batched_tokens: int = 8192
    enable_cuda_graph: bool = False
    max_num_seqs: int = 256
    # A recurrent model's prefix cache: state snapshots kept at block boundaries
    # (``mamba_state``; the scheduler's ``state_cache`` directs them). 0: none.
    state_snapshots: int = 0
    num_speculative_tokens: int = 0
    speculative_model: str | None = None
    speculative_method: str = "draft_model"
    speculative_quantization: str | None = None
    cpu_packed_weights: bool = True
    num_threads: int | None = None
    max_lora_rank: int = 0
    max_loaded_loras: int = 0
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    quantization: str | None = None
    batch_invariant: bool = False
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"
    hybrid_kv_cache: bool = True
    enable_images: bool = True
    enable_videos: bool = True
    logits_processors: tuple[Any, ...] = ()  # classes or "pkg.mod:Cls" names (sampling rank)
    hf_overrides: dict[str, Any] | None = None  # laid over config.json (vLLM's)
    extra: dict[str, Any] = field(default_factory=dict)

    def vision_encoded(self, image: Any) -> bool:
        """Whether a file with these image facts (``ImageConfig``, None: text only) gets
        its vision encoder: for pictures, or for videos where it takes them."""
        return image is not None and (self.enable_images or (
            self.enable_videos and image.video_token_id is not None))

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_quantization(self.quantization, self.device.split(":")[0])
        check_placement(self.expert_placement_strategy)
        if self.max_lora_rank < 0:
            raise ValueError(f"max_lora_rank must be >= 0, got {self.max_lora_rank}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(
                f"rank must be in [0, {self.tensor_parallel_size}), got {self.rank}"
            )
        self._check_pipeline()
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_model is not None and self.num_speculative_tokens < 1:
            raise ValueError("speculative_model needs num_speculative_tokens >= 1")
        parse_dtype(self.dtype)

    def _check_pipeline(self) -> None:
        """The stage index, and what pipeline stages cannot serve yet."""
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        if not 0 <= self.pp_rank < pp:
            raise ValueError(f"pp_rank must be in [0, {pp}), got {self.pp_rank}")
        if pp > 1 and self.max_lora_rank:
            raise ValueError("LoRA adapters are not supported with pipeline_parallel_size > 1")
        if pp > 1 and self.batch_invariant:
            raise ValueError("batch_invariant is not supported with pipeline_parallel_size > 1")

    @property
    def world_size(self) -> int:
        """Ranks of the whole engine: every stage's tensor-parallel group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)
