"""Model registry: HF ``model_type`` -> model class."""

from __future__ import annotations

from pagedserve.worker.models.bamba import BambaForCausalLM
from pagedserve.worker.models.bert import BertModel
from pagedserve.worker.models.deepseek import DeepseekForCausalLM
from pagedserve.worker.models.falcon_h1 import FalconH1ForCausalLM
from pagedserve.worker.models.gemma3 import Gemma3ForCausalLM
from pagedserve.worker.models.glm4 import Glm4ForCausalLM
from pagedserve.worker.models.glm4_moe import Glm4MoeForCausalLM
from pagedserve.worker.models.granite import GraniteForCausalLM
from pagedserve.worker.models.granite_hybrid import GraniteHybridForCausalLM
from pagedserve.worker.models.jamba import JambaForCausalLM
from pagedserve.worker.models.lfm2 import Lfm2ForCausalLM
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.mamba_lm import MambaForCausalLM
from pagedserve.worker.models.modernbert import ModernBertModel
from pagedserve.worker.models.nemotron_h import NemotronHForCausalLM
from pagedserve.worker.models.olmo import OlmoForCausalLM
from pagedserve.worker.models.qwen3_next import Qwen3NextForCausalLM
from pagedserve.worker.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "gpt_oss": LlamaForCausalLM,  # (attention sinks, biased clamped experts: flags)
    "granite": GraniteForCausalLM,  # (four scalars: ``granite_config``)
    "granitemoe": GraniteForCausalLM,  # (its experts stacked: ``layers.moe_granite``)
    "granitemoeshared": GraniteForCausalLM,
    "granitemoehybrid": GraniteHybridForCausalLM,  # (Mamba-2 layers: ``layers.mamba2``)
    "nemotron_h": NemotronHForCausalLM,  # (Mamba-2, attention and MLP blocks)
    "bamba": BambaForCausalLM,  # (Granite 4.0-H's Mamba-2 layers, Llama's otherwise)
    "falcon_h1": FalconH1ForCausalLM,  # (a Mamba-2 mixer beside each attention)
    "jamba": JambaForCausalLM,  # (Mamba-1 layers: ``layers.mamba1``; experts every other)
    "mamba": MambaForCausalLM,  # (attention-free: Mamba-1 blocks, no KV at all)
    "falcon_mamba": MambaForCausalLM,
    "mamba2": MambaForCausalLM,  # (Mamba-2 blocks)
    "qwen3_next": Qwen3NextForCausalLM,  # (gated DeltaNet: ``layers.gated_deltanet``)
    "qwen3_5_text": Qwen3NextForCausalLM,  # (Qwen3.5: the same, projections unfused)
    "qwen3_5_moe_text": Qwen3NextForCausalLM,
    "lfm2": Lfm2ForCausalLM,  # (gated short convolutions: ``layers.short_conv``)
    "lfm2_moe": Lfm2ForCausalLM,  # (and routed experts, sigmoid-scored)
    "olmo2": OlmoForCausalLM,  # (post-norms, whole-projection q/k norms: ``olmo_config``)
    "olmo3": OlmoForCausalLM,  # (and sliding layers with their own RoPE)
    "smollm3": SmolLM3ForCausalLM,  # (no RoPE on every fourth layer)
    "ernie4_5": LlamaForCausalLM,  # (interleaved RoPE: q / k rows reordered at load)
    "ernie4_5_moe": LlamaForCausalLM,  # (and routed experts: ``layers.moe_ernie``)
    "phi3": LlamaForCausalLM,  # (its fused qkv / gate_up projections load split)
    "gemma3_text": Gemma3ForCausalLM,
    "gemma2": Gemma3ForCausalLM,  # (Gemma 3's decoder without q/k norms, scores softcapped)
    "deepseek_v2": DeepseekForCausalLM,  # (multi-head latent attention, DeepSeekMoE)
    "deepseek_v3": DeepseekForCausalLM,
    "glm4": Glm4ForCausalLM,  # (four norms a layer, interleaved half-head RoPE)
    "glm4_moe": Glm4MoeForCausalLM,  # (GQA, partial RoPE, DeepSeek-V3's experts)
    "bert": BertModel,  # (encoders: embeddings and classification, ``encoder_config``)
    "roberta": BertModel,
    "xlm-roberta": BertModel,
    "modernbert": ModernBertModel,  # (RoPE, local attention: ``modernbert_config``)
}

__all__ = ["MODEL_REGISTRY", "BertModel", "DeepseekForCausalLM", "Gemma3ForCausalLM",
           "Glm4ForCausalLM", "Glm4MoeForCausalLM",
           "GraniteForCausalLM", "GraniteHybridForCausalLM", "JambaForCausalLM",
           "LlamaForCausalLM", "MambaForCausalLM",
           "ModernBertModel", "NemotronHForCausalLM", "OlmoForCausalLM",
           "SmolLM3ForCausalLM"]
