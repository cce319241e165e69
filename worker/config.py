"""Model and worker configuration.

``ModelConfig`` is the small, frozen subset of a Hugging Face config that the
Llama-family model actually needs. Building it once, with validation that names
the offending field, means a malformed checkpoint fails at load time with a
readable error instead of deep inside a matmul. ``WorkerConfig`` carries what
one tensor-parallel rank needs to start; it is a plain picklable dataclass so
the engine can ship it to Ray actors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.kernels.kv_quant import check_kv_cache_dtype, resolve_kv_cache_dtype
from pagedserve.worker.config_fields import positive_int, require
from pagedserve.worker.gemma_config import GEMMA_MODEL_TYPES, GemmaConfig, gemma_from_hf
from pagedserve.worker.image_config import ImageConfig, image_config_from_hf, llava_text_config
from pagedserve.worker.layers.expert_placement import check_placement
from pagedserve.worker.layers.quant import check_quantization
from pagedserve.worker.loaders.prequant_config import PrequantConfig, prequant_config
from pagedserve.worker.mla_config import MLA_MODEL_TYPES, MLAConfig, mla_config_from_hf
from pagedserve.worker.moe_config import MOE_MODEL_TYPES, MoEConfig, moe_config_from_hf
from pagedserve.worker.qwen_vl_config import QWEN_VL_MODEL_TYPES, qwen_vl_text_config
from pagedserve.worker.rope_config import parse_rope
from pagedserve.worker.window_config import sliding_window_layers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *MOE_MODEL_TYPES,
                         *GEMMA_MODEL_TYPES, "llava", "llava_next", "llava_onevision",
                         *QWEN_VL_MODEL_TYPES)

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


def _names_base_model(architectures: Any) -> bool:
    """True when ``architectures`` lists only base-model classes (``...Model``)."""
    if not isinstance(architectures, list) or not architectures:
        return False
    return all(isinstance(a, str) and a.endswith("Model") for a in architectures)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a Llama-family checkpoint (Llama 2/3, Mistral, Qwen2/3, SmolLM2,
    and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE)."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    # ``architectures`` names only a base model (``LlamaModel``, ``Qwen3Model``...): an
    # embedding checkpoint, saved without the ``model.`` prefix and without an LM head.
    embedding_only: bool = False
    # Routed experts (Mixtral, Qwen2/3-MoE); None for a dense model.
    moe: MoEConfig | None = None
    # A checkpoint quantised ahead of time (GPTQ, AWQ, compressed-tensors, fp8): its
    # projections are dequantised at load (``loaders.prequant``).
    prequant: PrequantConfig | None = None
    # Layers that attend through ``sliding_window`` (``window_config``); the rest see all.
    sliding_layers: tuple[int, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 3's departures from Llama (``gemma_config``)
    rotary_dim: int = 0  # dims of each head RoPE turns (partial_rotary_factor); 0: all
    # A multimodal file's image facts (``image_config``); None: text only.
    image: ImageConfig | None = None
    # Qwen2-VL's multimodal RoPE: the (temporal, row, column) shares of the rotary
    # frequencies (``qwen_vl_config``); empty: plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # DeepSeek's multi-head latent attention (``mla_config``): ``head_dim`` is then the
    # latent a token caches and ``num_kv_heads`` 1; None: plain attention.
    mla: MLAConfig | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; accepts both transformers 4 and 5 layouts.

        Transformers 5 writes ``rope_parameters`` (theta and scaling in one
        dict); older checkpoints have ``rope_theta`` plus ``rope_scaling``.
        """
        model_type = require(cfg, "model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model config field 'model_type' must be one of {SUPPORTED_MODEL_TYPES}, "
                f"got {model_type!r}"
            )
        image = image_config_from_hf(cfg)
        if model_type in ("llava", "llava_next", "llava_onevision"):  # decoder behind a tower
            cfg = llava_text_config(cfg)
            model_type = cfg["model_type"]
            if model_type not in SUPPORTED_MODEL_TYPES or model_type in GEMMA_MODEL_TYPES:
                raise ValueError(f"model config field 'text_config.model_type' must be one of "
                                 f"{SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        mrope_section: tuple[int, ...] = ()
        if model_type in QWEN_VL_MODEL_TYPES:  # a Qwen2 decoder with multimodal RoPE
            cfg, mrope_section = qwen_vl_text_config(cfg)
            model_type = "qwen2"
        cfg, gemma = gemma_from_hf(cfg, model_type)
        model_type = cfg["model_type"]  # a multimodal Gemma 3 serves its text decoder
        hidden = positive_int("hidden_size", require(cfg, "hidden_size"))
        heads = positive_int("num_attention_heads", require(cfg, "num_attention_heads"))
        kv_heads = positive_int(
            "num_key_value_heads", cfg.get("num_key_value_heads") or heads
        )
        if heads % kv_heads:
            raise ValueError(
                f"model config field 'num_key_value_heads' ({kv_heads}) must divide "
                f"num_attention_heads ({heads})"
            )
        head_dim, field = cfg.get("head_dim") or hidden // heads, "head_dim"
        if model_type in MLA_MODEL_TYPES:  # the part of a head RoPE turns
            head_dim, field = cfg.get("qk_rope_head_dim"), "qk_rope_head_dim"
        positive_int(field, head_dim)
        if head_dim % 2:
            raise ValueError(f"model config field {field!r} must be even for RoPE, got {head_dim}")
        if cfg.get("mlp_bias"):
            raise ValueError("model config field 'mlp_bias' = true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model config field 'hidden_act' must be 'silu', got "
                             f"{cfg.get('hidden_act')!r}")
        theta, scaling, rotary_dim = parse_rope(cfg, head_dim, model_type)
        if mrope_section and 2 * sum(mrope_section) != rotary_dim:
            raise ValueError(f"model config field 'rope_parameters.mrope_section' "
                             f"{list(mrope_section)} must add up to half the rotary dims "
                             f"({rotary_dim // 2})")

        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        if model_type in ("qwen2", "qwen2_moe"):
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        num_layers = positive_int("num_hidden_layers", require(cfg, "num_hidden_layers"))
        mla = mla_config_from_hf(cfg, model_type, scaling)
        if mla is not None:  # the cache holds one latent "head" a token (``mla_config``)
            head_dim, kv_heads, rotary_dim = mla.cache_dim, 1, mla.cache_dim
        window, sliding_layers = sliding_window_layers(cfg, model_type, num_layers)
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=positive_int(
                "intermediate_size", require(cfg, "intermediate_size")
            ),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=positive_int("vocab_size", require(cfg, "vocab_size")),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            max_position_embeddings=positive_int(
                "max_position_embeddings", cfg.get("max_position_embeddings", 2048)
            ),
            sliding_window=window,
            sliding_layers=sliding_layers,
            gemma=gemma,
            image=image,
            mrope_section=mrope_section,
            rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            dtype=str(dtype),
            embedding_only=_names_base_model(cfg.get("architectures")),
            moe=moe_config_from_hf(cfg, model_type, num_layers),
            prequant=prequant_config(cfg.get("quantization_config")),
            mla=mla,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` from a local HF directory.

        EOS ids from ``generation_config.json`` are merged in: Llama 3 Instruct,
        for one, lists its end-of-turn tokens only there, and HF ``generate``
        stops on them.
        """
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        cfg = json.loads(cfg_path.read_text())
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                own = cfg.get("eos_token_id")
                own = [] if own is None else (own if isinstance(own, list) else [own])
                extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
                cfg["eos_token_id"] = own + [e for e in extra if e not in own]
        from pagedserve.worker.loaders.prequant_config import legacy_quantization_config
        cfg.setdefault("quantization_config", legacy_quantization_config(Path(path)))
        return cls.from_hf_dict(cfg)

    @property
    def max_model_len(self) -> int:
        """Longest sequence we serve (a sliding window caps nothing). YaRN stretches the
        pre-training length by its factor (Qwen2.5's recipe adds ``factor: 4`` over 32768
        positions, keeping ``max_position_embeddings`` at 32768): the longer counts, as in vLLM.
        """
        longest = self.max_position_embeddings
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "yarn":
            stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
            longest = max(longest, stretched)
        return longest

    @property
    def long_rope_from(self) -> int:
        """LongRoPE's pre-trained length (its short factors' reach), 0 for other RoPE."""
        scaling = self.rope_scaling or {}
        return scaling["original_max_position_embeddings"] \
            if scaling.get("rope_type") == "longrope" else 0

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None where it attends to every key."""
        return self.sliding_window if layer in self.sliding_layers else None


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
    and projector); off, the file serves text only and the tower is never read.

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
    extra: dict[str, Any] = field(default_factory=dict)

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
