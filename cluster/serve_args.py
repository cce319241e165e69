"""What ``build_app`` takes (``ServeArgs``) and the engine settings derived from it.

Kept apart from the HTTP ingress: the CLI, ``serve run`` configs and tests
build these, and every bad value fails here, before anything is deployed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.disagg import PREFILL_DEPLOYMENT, RemotePrefillConfig
from pagedserve.cluster.lora_serving import AdapterCatalog, parse_lora_modules
from pagedserve.cluster.placement import cpu_threads_per_rank


@dataclass
class ServeSettings:
    """``ServeArgs`` resolved: the device, threads per rank, the engine's kwargs, and the
    adapters (absolute paths: replicas start in other working directories)."""

    device: str
    threads: int | None
    engine_kwargs: dict[str, Any]
    lora_modules: dict[str, str]
    lora_dir: str | None


class ServeArgs(BaseModel):
    """Everything ``build_app`` takes; the same keys work as ``args:`` in a Serve config."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    served_model_name: str | list[str] | None = None  # vLLM's: several names for one model
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of layers, each a TP group (``worker.pipeline``)
    pipeline_layer_partition: str | list[int] | None = None  # layers per stage ("19,11")
    max_concurrent_batches: int | None = None  # plans in flight (default: one per stage)
    num_replicas: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    quantization: Literal["int8", "int4", "gptq", "awq", "compressed-tensors", "fp8",
                          "mxfp4"] | None = None
    batch_invariant: bool = False  # logits independent of the batch (``worker.batch_invariant``)
    enable_expert_parallel: bool = False  # whole experts per TP rank (``layers.expert_placement``)
    expert_placement_strategy: Literal["linear", "round_robin"] = "linear"
    disable_hybrid_kv_cache_manager: bool = False  # one block table for every layer
    limit_mm_per_prompt: dict[str, int] | None = None  # images a prompt may carry (vLLM's)
    allowed_local_media_path: str | None = None  # image URLs may name files under it
    mm_processor_kwargs: dict[str, Any] | None = None  # the processor's options (vLLM's)
    enable_prompt_embeds: bool = False  # /v1/completions takes prompt_embeds (vLLM's)
    logits_processors: list[str] | None = None  # "pkg.mod:Cls" custom processors (vLLM's)
    hf_overrides: dict[str, Any] | None = None  # laid over config.json (vLLM's)
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_offloading_size: float = Field(default=0.0, ge=0.0)
    mamba_cache_mode: Literal["none", "align"] = "none"  # hybrids' prefix caching (vLLM's)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    speculative_config: dict[str, Any] | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_threads: int | None = None
    burst_wait_ms: float | None = Field(default=None, ge=0.0, le=1000.0)
    engine_kwargs: dict[str, Any] = {}
    max_ongoing_requests: int = 64
    max_queued_requests: int = 128
    api_key: str | None = None
    ingress_replicas: int = 1
    ingress_on_head: bool = True  # the ingress (clients' connections) outlives worker nodes
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 60.0
    replica_num_cpus: float | None = None
    placement_group_strategy: str = "PACK"
    stream_interval_ms: float = Field(default=50.0, ge=0.0)
    stream_messages_per_s: float | None = Field(default=None, ge=0.0)
    resume_streams: bool = True  # a dead replica's streams go on elsewhere (``resume``)
    # A request moved off a dead replica waits this long for a replica to take it.
    failover_wait_s: float = Field(default=60.0, gt=0.0)
    # Non-streamed requests send the ingress their tokens this often, to resume from too.
    checkpoint_interval_ms: float = Field(default=1000.0, ge=0.0)
    # A replica being replaced (a redeploy), scaled down or stopped finishes its open
    # requests for up to this long; past it an engine replica's requests resume elsewhere.
    drain_timeout_s: float = Field(default=600.0, ge=0.0)
    # How often a stopping replica looks for open requests (Serve's option, its default):
    # its first look comes after one period, the time routers get to stop sending to it.
    graceful_shutdown_wait_loop_s: float = Field(default=2.0, gt=0.0)
    imbalance_threshold: int = 8
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | list[str] | None = None
    lora_dir: str | None = None
    allow_runtime_lora_updating: bool = False  # vLLM's /v1/load_lora_adapter and unload
    max_loaded_loras: int | None = None
    # The Responses API's store (previous_response_id, background, GET/DELETE/cancel).
    enable_responses_store: bool = False
    responses_store_max_entries: int = Field(default=10_000, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    priority_aging_s: float | None = None  # seconds waited that count as one level
    long_prefill_token_threshold: int = Field(default=0, ge=0)  # one prompt's tokens a step
    pooling_type: Literal["last", "mean", "cls"] | None = None  # None: the model's
    reasoning_parser: Literal["qwen3", "deepseek_r1", "openai_gptoss"] | None = None
    prefill_replicas: int = Field(default=0, ge=0)
    remote_prefill_min_tokens: int = Field(default=64, ge=1)
    remote_prefill_timeout_s: float = Field(default=60.0, gt=0.0)
    remote_prefill_max_inflight: int | None = Field(default=None, ge=1)
    prefill_autoscaling_config: dict[str, Any] | None = None

    @classmethod
    def parse(cls, args: ServeArgs | Mapping[str, Any] | Any | None) -> ServeArgs:
        """From a ``ServeArgs``, a mapping, an argparse result (its known keys) or None."""
        if args is None:
            return cls()
        if isinstance(args, ServeArgs):
            return args
        if isinstance(args, Mapping):
            return cls(**args)
        return cls(**{k: v for k, v in vars(args).items() if k in cls.model_fields})

    def autoscaling(self) -> dict[str, Any] | None:
        """Serve's ``autoscaling_config`` for the engine replicas, checked by Serve's own
        model. ``min_replicas: 0`` scales to zero: the first request after idling waits
        for a replica to start and load the model."""
        return _checked_autoscaling(self.autoscaling_config, "autoscaling_config")

    def prefill_autoscaling(self) -> dict[str, Any] | None:
        """The prefill pool's own ``autoscaling_config`` (Serve scales it on the decode
        replicas' calls), in place of the fixed ``prefill_replicas``."""
        cfg = _checked_autoscaling(self.prefill_autoscaling_config,
                                   "prefill_autoscaling_config")
        if cfg is not None and not self.prefill_replicas:
            raise ValueError("prefill_autoscaling_config needs prefill_replicas >= 1 "
                             "(the pool's size until Serve scales it)")
        return cfg

    @property
    def world_size(self) -> int:
        """Rank actors of one engine replica: a TP group per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def max_replicas(self) -> int:
        """The most engine replicas there can be, prefill ones included: what CPU threads
        are sized for."""
        cfg, pcfg = self.autoscaling(), self.prefill_autoscaling()
        most = int(cfg.get("max_replicas", 1)) if cfg is not None else self.num_replicas
        return most + (int(pcfg.get("max_replicas", 1)) if pcfg is not None
                       else self.prefill_replicas)

    def scales_to_zero(self) -> bool:
        cfg = self.autoscaling()
        return cfg is not None and cfg.get("min_replicas", 1) == 0

    def engine_options(self, s: ServeSettings) -> dict[str, Any]:
        """``EngineServer.options`` for the engine replicas: bounds, health checks, the
        prefix-affinity router, placement, and replicas or autoscaling."""
        from ray.serve.config import RequestRouterConfig

        from pagedserve.cluster.placement import engine_replica_options
        from pagedserve.cluster.router import ROUTER_CLASS_PATH

        opts: dict[str, Any] = dict(
            # Each ingress replica holds one channel subscription per engine replica, and
            # Serve counts it as an ongoing request: room for it on top of the user's bound.
            num_replicas=self.num_replicas,
            max_ongoing_requests=self.max_ongoing_requests + self.ingress_replicas,
            max_queued_requests=self.max_queued_requests,
            health_check_period_s=self.health_check_period_s,
            health_check_timeout_s=self.health_check_timeout_s,
            graceful_shutdown_timeout_s=self.drain_timeout_s,
            graceful_shutdown_wait_loop_s=self.graceful_shutdown_wait_loop_s,
            request_router_config=RequestRouterConfig(
                request_router_class=ROUTER_CLASS_PATH,
                request_router_kwargs={"imbalance_threshold": self.imbalance_threshold}),
        )
        opts.update(engine_replica_options(s.device == "cuda", s.threads,
                                           self.world_size, self.replica_num_cpus,
                                           self.placement_group_strategy))
        autoscaling = self.autoscaling()
        if autoscaling is not None:  # Serve scales on each replica's ongoing requests
            del opts["num_replicas"]
            opts["autoscaling_config"] = autoscaling
        return opts

    def prefill_options(self, engine_options: dict[str, Any]) -> dict[str, Any]:
        """The prefill pool's: the engine replicas' placement and router, and
        ``prefill_replicas`` or ``prefill_autoscaling_config``."""
        opts = {k: v for k, v in engine_options.items()
                if k not in ("autoscaling_config", "num_replicas")}
        pcfg = self.prefill_autoscaling()
        if pcfg is not None:
            return {**opts, "name": PREFILL_DEPLOYMENT, "autoscaling_config": pcfg}
        return {**opts, "name": PREFILL_DEPLOYMENT, "num_replicas": self.prefill_replicas}

    def remote_prefill(self) -> RemotePrefillConfig | None:
        """With prefill replicas: when a decode replica sends a prompt to them."""
        if not self.prefill_replicas:
            return None
        return RemotePrefillConfig(self.remote_prefill_min_tokens,
                                   self.remote_prefill_timeout_s,
                                   self.remote_prefill_max_inflight)

    def settings(self) -> ServeSettings:
        """Resolve the device and threads, check the adapters and the engine config."""
        device = resolve_device(self.device)
        lora_modules = {name: os.path.abspath(path)
                        for name, path in parse_lora_modules(self.lora_modules).items()}
        lora_dir = os.path.abspath(self.lora_dir) if self.lora_dir else None
        AdapterCatalog(lora_modules, lora_dir, ())  # a bad name or directory fails here
        if self.allow_runtime_lora_updating and self.ingress_replicas != 1:
            raise ValueError("allow_runtime_lora_updating needs ingress_replicas=1 (each "
                             "ingress replica keeps its own list; use lora_dir instead)")
        threads = self.num_threads
        if device == "cpu" and threads is None:
            threads = cpu_threads_per_rank(self.max_replicas(), self.world_size)
        engine_kwargs: dict[str, Any] = dict(
            model=self.model, tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size, device=device,
            pipeline_layer_partition=self.pipeline_layer_partition,
            max_concurrent_batches=self.max_concurrent_batches,
            dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales, quantization=self.quantization,
            batch_invariant=self.batch_invariant,
            enable_expert_parallel=self.enable_expert_parallel,
            expert_placement_strategy=self.expert_placement_strategy,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            limit_mm_per_prompt=self.limit_mm_per_prompt,
            allowed_local_media_path=self.allowed_local_media_path,
            mm_processor_kwargs=self.mm_processor_kwargs,
            enable_prompt_embeds=self.enable_prompt_embeds,
            logits_processors=self.logits_processors, hf_overrides=self.hf_overrides,
            num_gpu_blocks=self.num_gpu_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            kv_offloading_size=self.kv_offloading_size,
            mamba_cache_mode=self.mamba_cache_mode,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, speculative_config=self.speculative_config,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, num_threads=threads,
            burst_wait_ms=self.burst_wait_ms,
            enable_lora=self.enable_lora or bool(lora_modules) or lora_dir is not None
            or self.allow_runtime_lora_updating,
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
            lora_modules=lora_modules or None, max_loaded_loras=self.max_loaded_loras,
            scheduling_policy=self.scheduling_policy, priority_aging_s=self.priority_aging_s,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            **self.engine_kwargs)
        EngineConfig(**engine_kwargs)  # a bad setting fails here, naming the field
        self.prefill_autoscaling()  # checked whatever the device
        if self.prefill_replicas and not engine_kwargs.get("enable_prefix_caching", True):
            raise ValueError("prefill_replicas needs enable_prefix_caching: shipped KV "
                             "blocks reach a request through the prefix cache")
        return ServeSettings(device, threads, engine_kwargs, lora_modules, lora_dir)


def _checked_autoscaling(cfg: dict[str, Any] | None, field: str) -> dict[str, Any] | None:
    """A copy of ``cfg`` once Serve's own model accepts it; unknown keys name ``field``."""
    if cfg is None:
        return None
    from ray.serve.config import AutoscalingConfig

    unknown = set(cfg) - set(AutoscalingConfig.model_fields)
    if unknown:
        raise ValueError(f"{field}: unknown keys {sorted(unknown)}")
    AutoscalingConfig(**cfg)
    return dict(cfg)


def resolve_device(device: str) -> str:
    """``auto`` means CUDA when the Ray cluster has GPUs (replicas see none until placed)."""
    if device != "auto":
        return device
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1:
        return "cuda"
    return "cpu"
