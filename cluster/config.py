"""Engine settings: one frozen dataclass, validated on creation, that names the bad field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.scheduler.spec_decode import SpeculativeConfig
from pagedserve.worker.pipeline import check_partition

EXECUTORS = ("auto", "local", "ray")
FLASH_BLOCK_SIZE = 256
ENGINE_CPU_KV_BYTES = 512 << 20  # the KV pool on CPU when no budget is given
DEFAULT_IMAGE_LIMIT = 16  # images one prompt may carry unless limit_mm_per_prompt says
DEFAULT_VIDEO_LIMIT = 4  # videos likewise (a video is many pictures' tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine replica needs: model, parallelism, KV pool and batching.

    On CPU the KV pool is sized by ``num_gpu_blocks`` or ``kv_cache_memory_bytes``
    (default 512 MiB); on CUDA by ``gpu_memory_utilization`` after profiling.
    ``pipeline_parallel_size`` cuts the layers into that many stages, each a group of
    ``tensor_parallel_size`` Ray actors (``worker.pipeline``). ``max_concurrent_batches``
    (default: one per stage) is how many step plans are in flight at once, so every
    stage works on a micro-batch of its own instead of waiting for the others; 1
    runs one plan through the stages at a time. ``pipeline_layer_partition`` sets the
    layers of each stage ("19,11" or a list; default: as even as they divide), for a
    model whose LM head costs the last stage several layers.
    ``swap_space_bytes`` sizes the CPU swap tier (0 disables swap: preemption
    then always recomputes). ``kv_offloading_size`` (GiB, vLLM's option; or
    ``num_offload_blocks``) adds that much to the CPU tier and makes it a second
    level of the prefix cache: full blocks evicted from the device are copied
    there, and later prompts that continue past the device's cache load them
    back instead of computing them (``scheduler.cpu_block_pool``).
    ``burst_wait_ms`` is how long an idle async engine, woken by a request,
    waits for the rest of its burst: None sizes it from the engine's measured
    steps, 0 turns it off (see ``cluster.burst``).
    On CUDA, decode steps replay captured CUDA graphs unless ``enforce_eager``.
    ``dtype`` "auto" is bf16 on CUDA and fp32 on CPU (where fp32 equals Hugging
    Face token for token; bf16 is ~1.7x faster on CPUs with bf16 dot products).
    ``speculative_config`` turns on n-gram speculative decoding
    (``scheduler.spec_decode``); a dict is parsed into a ``SpeculativeConfig``.
    ``enable_lora`` serves PEFT LoRA adapters of rank <= ``max_lora_rank`` next to the
    base model, at most ``max_loras`` different ones in a step (vLLM's names);
    ``lora_modules`` (name -> PEFT directory) are loaded at start; at most
    ``max_loaded_loras`` (default: 16, or ``max_loras`` if more) stay loaded, the
    least recently used idle one unloaded to make room (and reloaded when named).
    ``kv_cache_dtype`` (vLLM's option) stores the KV pool in another element type:
    "auto" (the model dtype), "float16" / "bfloat16", or "fp8" (= "fp8_e4m3") /
    "fp8_e5m2"; the same byte budget then holds 2x or 4x the tokens of an fp32 pool.
    ``calculate_kv_scales`` (fp8 only) stores each layer's K and V over a scale set
    at start-up from a fixed calibration text (vLLM's option, which uses the first
    batch instead; without it the scale is 1.0).
    ``quantization`` "int8" serves the projections as 8-bit weights with a scale per
    32 inputs, run on int8 activations; "int4" as 4-bit weights with a scale and a
    minimum per 32 (``worker.layers.quant``; on CUDA int4 only, ``kernels.triton_w4a16``).
    ``scheduling_policy`` "priority" orders waiting, swapped and running requests by
    each request's ``priority`` (lower first), then arrival; "fcfs" by arrival only.
    ``priority_aging_s`` (priority only) counts each that many seconds a request has
    waited as one level more urgent, so no request starves (``scheduler.queues``).
    ``long_prefill_token_threshold`` (0: off) caps one prompt's tokens per step, so
    prompts that arrive behind a long one start in the same steps (vLLM's option).
    ``batch_invariant`` makes a request's logits independent of what else runs in its
    steps, bit for bit (CPU only; ``worker.batch_invariant``).
    ``enable_expert_parallel`` (vLLM's option) gives each rank of a tensor-parallel
    group whole routed experts of a mixture-of-experts model, a share of them placed by
    ``expert_placement_strategy`` ("linear" or "round_robin"), instead of a slice of
    every expert (``worker.layers.expert_placement``); attention stays tensor-parallel.
    ``disable_hybrid_kv_cache_manager`` (vLLM's option) keeps one block table for every
    layer of a model that mixes full and sliding-window layers (Gemma 2 and 3), so its
    sliding layers hold every block too; by default each kind of layer has its own
    tables and sliding ones give back what falls behind the window
    (``scheduler.hybrid_kv``).
    ``limit_mm_per_prompt`` (vLLM's option) caps the images one prompt may carry
    (``{"image": 4}``; None: 16); ``{"image": 0}`` serves a multimodal file as text
    only, its vision encoder never loaded. ``allowed_local_media_path`` (vLLM's) lets
    image URLs name local files under that directory (``file://``); off by default.
    ``mm_processor_kwargs`` (vLLM's) sets the multimodal processor's options, e.g.
    Gemma 3's ``{"do_pan_and_scan": true}`` or Qwen2-VL's ``min_pixels`` /
    ``max_pixels``; a key the model's processor does not take is refused by name
    (``processor_options``).
    ``enable_prompt_embeds`` (vLLM's, off by default): prompts as input embeddings.
    ``logits_processors`` (vLLM's): custom processor classes (``worker.logits_processors``).
    ``hf_overrides`` (vLLM's): keys laid over the model's ``config.json``, e.g. to serve
    a causal LM as a classifier (``worker.classifier``).
    """

    model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_concurrent_batches: int | None = None
    pipeline_layer_partition: str | tuple[int, ...] | list[int] | None = None
    executor: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space_bytes: int = 256 * 2**20
    num_cpu_blocks: int | None = None
    kv_offloading_size: float = 0.0
    num_offload_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Prefix caching for hybrid recurrent models (vLLM's option): "align" keeps state
    # snapshots at block boundaries (``scheduler.state_cache``); "none" leaves their
    # prefix caching off.
    mamba_cache_mode: str = "none"
    preemption_mode: str = "swap"
    seed: int = 0
    num_threads: int | None = None
    burst_wait_ms: float | None = None
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None
    max_loaded_loras: int | None = None
    scheduling_policy: str = "fcfs"
    priority_aging_s: float | None = None
    long_prefill_token_threshold: int = 0
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    quantization: str | None = None
    batch_invariant: bool = False
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"
    disable_hybrid_kv_cache_manager: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    enable_prompt_embeds: bool = False
    logits_processors: list[str | type] | None = None
    hf_overrides: dict[str, Any] | None = None
    worker_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # vLLM's dict form (``{"method": "ngram", "num_speculative_tokens": 4}``), parsed.
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_dict(self.speculative_config))
        limit = self.limit_mm_per_prompt
        if limit is not None and (not isinstance(limit, dict) or set(limit) - {"image", "video"}
                                  or not all(isinstance(v, int) and not isinstance(v, bool)
                                             and v >= 0 for v in limit.values())):
            raise ValueError("limit_mm_per_prompt must map 'image' and / or 'video' to an "
                             f"integer >= 0, got {limit!r}")
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs,
                                                                   dict):
            raise ValueError(f"mm_processor_kwargs must be a JSON object, got "
                             f"{self.mm_processor_kwargs!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {self.hf_overrides!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True")
        n = self.max_loaded_loras
        if n is not None and (not isinstance(n, int) or n < self.max_loras):
            raise ValueError(f"max_loaded_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {n!r}")
        from pagedserve.kernels.kv_quant import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        from pagedserve.worker.layers.quant import check_quantization

        check_quantization(self.quantization,
                           None if self.device == "auto" else self.device)
        if self.batch_invariant:
            self._check_batch_invariant()
        if self.logits_processors:
            from pagedserve.worker.logits_processors import check_engine_processors

            check_engine_processors(self.logits_processors, self.speculative_config)
        from pagedserve.worker.layers.expert_placement import check_placement

        check_placement(self.expert_placement_strategy)
        from pagedserve.scheduler.config import SchedulerConfig

        # The policy, its aging and the prompt cap, checked where the scheduler checks them.
        SchedulerConfig(policy=self.scheduling_policy, priority_aging_s=self.priority_aging_s,
                        long_prefill_token_threshold=self.long_prefill_token_threshold,
                        enable_chunked_prefill=self.enable_chunked_prefill,
                        max_num_batched_tokens=2**30, max_model_len=2**30)
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}"
            )
        self._check_pipeline()
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype != "auto":
            from pagedserve.worker.worker_config import parse_dtype

            parse_dtype(self.dtype)  # raises naming the field and the accepted names
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        wait = self.burst_wait_ms
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not 0.0 <= wait <= 1000.0):
            raise ValueError(f"burst_wait_ms must be None (auto) or in [0, 1000], got {wait!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        size = self.kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {size!r}")
        n = self.num_offload_blocks
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"num_offload_blocks must be an integer >= 0, got {n!r}")
        if self.offloads_kv() and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching: offloaded "
                             "blocks come back as prefix-cache hits")
        if self.mamba_cache_mode not in ("none", "align"):
            raise ValueError(f"mamba_cache_mode must be 'none' or 'align', got "
                             f"{self.mamba_cache_mode!r}")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be swap or recompute, got {self.preemption_mode!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def _check_pipeline(self) -> None:
        """``pipeline_parallel_size``: a positive integer, its stages as Ray actors, and
        none of what stages cannot serve yet (refused before any actor starts)."""
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        depth = self.max_concurrent_batches
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                                  or not 1 <= depth <= pp):
            raise ValueError(f"max_concurrent_batches must be an integer from 1 to "
                             f"pipeline_parallel_size ({pp}), got {depth!r}: a plan "
                             "beyond one per stage would only wait")
        sizes = self.pipeline_layer_partition
        if sizes is not None:
            if isinstance(sizes, str):
                try:
                    sizes = tuple(int(n) for n in sizes.split(","))
                except ValueError:
                    raise ValueError("pipeline_layer_partition must be comma-separated "
                                     f"layer counts such as '19,11', got {sizes!r}") from None
            check_partition(tuple(sizes), pp)
            object.__setattr__(self, "pipeline_layer_partition", tuple(sizes))
        if pp == 1:
            return
        if self.executor == "local":
            raise ValueError("pipeline_parallel_size > 1 needs executor 'ray' (or 'auto'): "
                             "each stage is its own process")
        if self.enable_lora:
            raise ValueError("enable_lora is not supported with pipeline_parallel_size > 1")
        if self.batch_invariant:
            raise ValueError("batch_invariant is not supported with pipeline_parallel_size > 1")

    def resolved_max_concurrent_batches(self) -> int:
        """Plans in flight at once: as given, else one per pipeline stage."""
        return self.max_concurrent_batches or self.pipeline_parallel_size

    def resolved_layer_partition(self) -> tuple[int, ...] | None:
        """Layers per stage as a tuple (``__post_init__`` parsed and checked it), or
        None for an even split."""
        sizes = self.pipeline_layer_partition
        return None if sizes is None else tuple(int(n) for n in sizes)

    @property
    def world_size(self) -> int:
        """Ranks of one engine: ``tensor_parallel_size`` per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_batch_invariant(self) -> None:
        """Refuse at once what the workers would refuse after loading the model."""
        if self.device == "cuda":
            raise ValueError("batch_invariant runs on CPU only (device='cuda')")
        if self.attention_backend not in (None, "cpu"):
            raise ValueError("batch_invariant needs the 'cpu' attention backend, not "
                             f"{self.attention_backend!r} (attention_backend)")

    def cpu_tier_blocks(self, bytes_per_block: int) -> tuple[int, int]:
        """``(swap, offload)`` CPU blocks of ``bytes_per_block`` each: no swap blocks in
        recompute mode; the offloading share must hold at least one block. A model that
        keeps no KV (attention-free: its blocks are bookkeeping) gets neither."""
        if bytes_per_block == 0:
            if self.offloads_kv():
                raise ValueError("kv_offloading_size: this model keeps no KV to offload (no "
                                 "layer attends)")
            return 0, 0
        swap = self.num_cpu_blocks
        if swap is None:
            swap = self.swap_space_bytes // bytes_per_block
        if self.preemption_mode == "recompute":
            swap = 0
        offload = self.num_offload_blocks
        if offload is None:
            offload = int(self.kv_offloading_size * 2**30) // bytes_per_block
        if self.offloads_kv() and offload == 0:
            raise ValueError(f"kv_offloading_size ({self.kv_offloading_size} GiB) holds no "
                             f"block of {bytes_per_block} bytes")
        return swap, offload

    def offloads_kv(self) -> bool:
        """Whether the CPU tier caches prefixes (an explicit block count wins)."""
        if self.num_offload_blocks is not None:
            return self.num_offload_blocks > 0
        return self.kv_offloading_size > 0

    def resolved_max_loaded_loras(self) -> int:
        return self.max_loaded_loras or max(16, self.max_loras)

    def resolved_dtype(self, device: str) -> str:
        """The model dtype: as given, else bf16 on CUDA and fp32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device == "cuda" else "float32"

    def resolved_block_size(self, device: str) -> int:
        """As given, else 16 where the backend chosen for this device and KV cache dtype
        takes it, else flash-attn's 256."""
        if self.block_size:
            return self.block_size
        from pagedserve.kernels import get_backend
        from pagedserve.kernels.kv_quant import resolve_kv_cache_dtype
        from pagedserve.worker.worker_config import parse_dtype

        model_dtype = parse_dtype(self.resolved_dtype(device))
        backend = get_backend(self.attention_backend, device,
                              resolve_kv_cache_dtype(self.kv_cache_dtype, model_dtype),
                              model_dtype)
        return 16 if backend.supports_block_size(16) else FLASH_BLOCK_SIZE

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_executor(self) -> str:
        if self.executor != "auto":
            return self.executor
        return "local" if self.world_size == 1 else "ray"

    @property
    def image_limit(self) -> int:
        """The most images one prompt may carry (``limit_mm_per_prompt``)."""
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGE_LIMIT)

    @property
    def video_limit(self) -> int:
        """The most videos one prompt may carry (``limit_mm_per_prompt``; a model
        without videos takes none whatever this says)."""
        return (self.limit_mm_per_prompt or {}).get("video", DEFAULT_VIDEO_LIMIT)
