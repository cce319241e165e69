"""Model and worker configuration.

``ModelConfig`` is the small, frozen subset of a Hugging Face config that the
Llama-family model actually needs. Building it once, with validation that names
the offending field, means a malformed checkpoint fails at load time with a
readable error instead of deep inside a matmul. What one rank needs to start is
``worker_config.WorkerConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.worker.classifier import (
    ClassifierConfig,
    classifier_config,
    merge_overrides,
    vocab_token_ids,
)
from pagedserve.worker.config_fields import matryoshka, nope_layers, positive_int, require
from pagedserve.worker.deltanet_config import (
    DELTANET_MODEL_TYPES,
    DeltaNetConfig,
    deltanet_config_from_hf,
    qwen3_5_text_config,
)
from pagedserve.worker.encoder_config import (
    ENCODER_MODEL_TYPES,
    EncoderConfig,
    encoder_model_config,
)
from pagedserve.worker.falcon_h1_config import (
    FalconH1Multipliers,
    falcon_h1_mamba_config,
    falcon_h1_multipliers,
)
from pagedserve.worker.gemma_config import GEMMA_MODEL_TYPES, GemmaConfig, gemma_from_hf
from pagedserve.worker.granite_config import GraniteScales, granite_from_hf
from pagedserve.worker.image_config import ImageConfig, image_config_from_hf, llava_text_config
from pagedserve.worker.lfm2_config import ShortConvConfig, lfm2_config
from pagedserve.worker.loaders.prequant_config import PrequantConfig, prequant_config
from pagedserve.worker.mamba1_config import Mamba1Config, jamba_mamba_config
from pagedserve.worker.mamba_config import (
    HYBRID_MODEL_TYPES,
    MambaConfig,
    mamba_config_from_hf,
    uses_rope,
)
from pagedserve.worker.mamba_lm_config import MAMBA_LM_MODEL_TYPES, mamba_lm_config
from pagedserve.worker.mla_config import MLA_MODEL_TYPES, MLAConfig, mla_config_from_hf
from pagedserve.worker.moe_config import MOE_MODEL_TYPES, MoEConfig, moe_config_from_hf
from pagedserve.worker.nemotron_h_config import nemotron_h_config
from pagedserve.worker.olmo_config import OLMO_MODEL_TYPES, olmo_rope
from pagedserve.worker.qwen_vl_config import QWEN_VL_MODEL_TYPES, qwen_vl_text_config
from pagedserve.worker.rope_config import parse_rope
from pagedserve.worker.window_config import sliding_window_layers

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3",
                         "ernie4_5", "glm4", *HYBRID_MODEL_TYPES, *DELTANET_MODEL_TYPES,
                         *OLMO_MODEL_TYPES, *MOE_MODEL_TYPES,
                         *GEMMA_MODEL_TYPES, "llava", "llava_next", "llava_onevision",
                         *QWEN_VL_MODEL_TYPES, *ENCODER_MODEL_TYPES)


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
    # ``architectures`` names a ``...ForSequenceClassification``: a ``score`` head of
    # ``num_labels`` rows replaces the LM head (``classifier``).
    classifier: ClassifierConfig | None = None
    # Routed experts (Mixtral, Qwen2/3-MoE); None for a dense model.
    moe: MoEConfig | None = None
    # A checkpoint quantised ahead of time (GPTQ, AWQ, compressed-tensors, fp8): its
    # projections are dequantised at load (``loaders.prequant``).
    prequant: PrequantConfig | None = None
    # Layers that attend through ``sliding_window`` (``window_config``); the rest see all.
    sliding_layers: tuple[int, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 3's departures from Llama (``gemma_config``)
    granite: GraniteScales | None = None  # Granite's four scalars (``granite_config``)
    # OLMo 3's sliding layers' own RoPE base (unscaled; ``olmo_config``); None: one table.
    local_rope_theta: float | None = None
    # Layers that rotate by nothing (SmolLM3's ``no_rope_layers`` zeros).
    nope_layers: tuple[int, ...] = ()
    # RoPE turns interleaved pairs (2i, 2i + 1) (Ernie 4.5, GLM-4): q / k rows reordered at
    # load to the half-split pairs our rotation turns (``fused_weights.neox_rows``).
    rope_interleaved: bool = False
    rotary_dim: int = 0  # dims of each head RoPE turns (partial_rotary_factor); 0: all
    # A multimodal file's image facts (``image_config``); None: text only.
    image: ImageConfig | None = None
    # Qwen2-VL's multimodal RoPE: the (temporal, row, column) shares of the rotary
    # frequencies (``qwen_vl_config``); empty: plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # DeepSeek's multi-head latent attention (``mla_config``): ``head_dim`` is then the
    # latent a token caches and ``num_kv_heads`` 1; None: plain attention.
    mla: MLAConfig | None = None
    # GPT-OSS's attention sinks: each layer holds a learnt logit per query head that
    # joins its softmax (``AttentionBackend.varlen_attention``).
    attention_sinks: bool = False
    # A BERT-family encoder (``encoder_config``): attends both ways, never generates.
    encoder: EncoderConfig | None = None
    # The embedding widths ``dimensions`` may cut to (``config_fields.matryoshka``):
    # a list, True any, False none; None: the file does not say.
    matryoshka: tuple[int, ...] | bool | None = None
    # A hybrid model's Mamba-2 layers and their mixers' shapes (``mamba_config``): they
    # hold per-sequence state, not KV; None: every layer attends.
    # (Qwen3-Next's gated DeltaNet layers, LFM2's short convolutions, Jamba's Mamba-1
    # layers: configs with the same fields.)
    mamba: MambaConfig | Mamba1Config | DeltaNetConfig | ShortConvConfig | None = None
    # Falcon-H1's muP multipliers (``falcon_h1_config``); None for other models.
    falcon_h1: FalconH1Multipliers | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], tokenizer_dir: str | None = None
                     ) -> ModelConfig:
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
        if model_type in ENCODER_MODEL_TYPES:
            return encoder_model_config(cls, cfg, tokenizer_dir)
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
        cfg = qwen3_5_text_config(cfg)  # (a multimodal Qwen3.5 serves its decoder)
        cfg, gemma = gemma_from_hf(cfg, cfg["model_type"])
        model_type = cfg["model_type"]  # a multimodal Gemma 3 serves its text decoder
        cfg, local_theta = olmo_rope(cfg, model_type)
        mamba = None
        if model_type == "nemotron_h":  # (its own field names: ``nemotron_h_config``)
            cfg, mamba = nemotron_h_config(cfg)
        elif model_type in ("lfm2", "lfm2_moe"):  # (and LFM2's: ``lfm2_config``)
            cfg, mamba = lfm2_config(cfg)
        elif model_type in MAMBA_LM_MODEL_TYPES:  # (attention-free: ``mamba_lm_config``)
            cfg, mamba = mamba_lm_config(cfg)
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
        if model_type in ("ernie4_5", "ernie4_5_moe") and cfg.get("use_bias"):
            raise ValueError("model config field 'use_bias' = true (biased MLPs) is not "
                             "supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model config field 'hidden_act' must be 'silu', got "
                             f"{cfg.get('hidden_act')!r}")
        if model_type == "bamba":  # (transformers turns half of each head, whatever the file)
            cfg = {**cfg, "rope_parameters": {**(cfg.get("rope_parameters") or {}),
                                              "partial_rotary_factor": 0.5}}
        theta, scaling, rotary_dim = parse_rope(cfg, head_dim, model_type)
        if mrope_section and 2 * sum(mrope_section) != rotary_dim:
            raise ValueError(f"model config field 'rope_parameters.mrope_section' "
                             f"{list(mrope_section)} must add up to half the rotary dims "
                             f"({rotary_dim // 2})")

        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        if model_type in ("qwen2", "qwen2_moe"):
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        elif model_type in ("glm4", "glm4_moe"):  # (no o_proj bias whatever attention_bias says)
            qkv_bias, o_bias = bool(cfg.get("attention_bias", False)), False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        num_layers = positive_int("num_hidden_layers", require(cfg, "num_hidden_layers"))
        mla = mla_config_from_hf(cfg, model_type, scaling)
        if mla is not None:  # the cache holds one latent "head" a token (``mla_config``)
            head_dim, kv_heads, rotary_dim = mla.cache_dim, 1, mla.cache_dim
        window, sliding_layers = sliding_window_layers(cfg, model_type, num_layers)
        mamba = mamba or mamba_config_from_hf(cfg, model_type, num_layers)
        if model_type == "falcon_h1":
            mamba = falcon_h1_mamba_config(cfg, num_layers)
        if model_type == "jamba":
            mamba = jamba_mamba_config(cfg, num_layers)
        if model_type in DELTANET_MODEL_TYPES:
            mamba = deltanet_config_from_hf(cfg, num_layers)
        nope = nope_layers(cfg, num_layers) if model_type == "smollm3" else ()
        if isinstance(mamba, MambaConfig):
            nope = () if uses_rope(cfg) else tuple(range(num_layers))
        if isinstance(mamba, Mamba1Config):  # (Jamba's attention rotates by nothing)
            nope = tuple(range(num_layers))
        if model_type == "granitemoehybrid" and not cfg.get("num_local_experts"):
            # (dense, granite-4.0-h-micro: the shared MLP is the layer's MLP)
            cfg = {**cfg, "intermediate_size": cfg.get("shared_intermediate_size")}
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
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "lfm2", "lfm2_moe",
                                   *DELTANET_MODEL_TYPES, *OLMO_MODEL_TYPES)
            or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm", False))),
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
            classifier=classifier_config(
                cfg, vocab_token_ids(tokenizer_dir) if tokenizer_dir else None),
            moe=moe_config_from_hf(cfg, model_type, num_layers),
            prequant=prequant_config(cfg.get("quantization_config")),
            mla=mla,
            attention_sinks=model_type == "gpt_oss",
            granite=granite_from_hf(cfg, model_type),
            local_rope_theta=local_theta,
            nope_layers=nope,
            mamba=mamba,
            rope_interleaved=model_type in ("ernie4_5", "ernie4_5_moe", "glm4"),
            falcon_h1=falcon_h1_multipliers(cfg) if model_type == "falcon_h1" else None,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str],
                        hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
        """Read ``config.json`` from a local HF directory, ``hf_overrides`` (vLLM's)
        laid over it.

        EOS ids from ``generation_config.json`` are merged in: Llama 3 Instruct,
        for one, lists its end-of-turn tokens only there, and HF ``generate``
        stops on them.
        """
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        cfg = merge_overrides(json.loads(cfg_path.read_text()), hf_overrides)
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
        return dataclasses.replace(cls.from_hf_dict(cfg, str(path)),
                                   matryoshka=matryoshka(cfg))

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
    def headless(self) -> bool:
        """No LM head in the file (an embedding model, a classifier): it never generates;
        a single stage ties a head to its embedding, a later pipeline stage holds none."""
        return self.embedding_only or self.classifier is not None

    @property
    def side_files(self) -> tuple[str, ...]:
        """Head files beside the checkpoint that load with it (BGE-M3's)."""
        mv = self.encoder.multi_vector if self.encoder is not None else None
        return mv.side_files if mv is not None else ()

    @property
    def long_rope_from(self) -> int:
        """LongRoPE's pre-trained length (its short factors' reach), 0 for other RoPE."""
        scaling = self.rope_scaling or {}
        return scaling["original_max_position_embeddings"] \
            if scaling.get("rope_type") == "longrope" else 0

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None where it attends to every key."""
        return self.sliding_window if layer in self.sliding_layers else None
