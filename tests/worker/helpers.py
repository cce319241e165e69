"""Builders shared by the worker tests: tiny HF checkpoints, workers and step plans."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.testing import MOE_DEFAULTS, QWEN3_5_VISION
from pagedserve.worker.worker import Worker
from pagedserve.worker.worker_config import WorkerConfig

TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, rms_norm_eps=1e-5,
    eos_token_id=2, bos_token_id=1,
)


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0,
                    **overrides: Any) -> Path:
    """Write a random tiny Llama, Qwen2/3, Mistral, Gemma 3 or mixture-of-experts (Mixtral,
    Qwen2/3-MoE, GPT-OSS: ``MOE_DEFAULTS``' experts) HF checkpoint (safetensors) to ``path``."""
    import transformers as tf

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM"),
               "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
               "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
               "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
               "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
               "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
               "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
               "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
               "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
               "glm4": ("Glm4Config", "Glm4ForCausalLM"),
               "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
               "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
               "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
               "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
               "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
               "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
               "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
               "jamba": ("JambaConfig", "JambaForCausalLM"),
               "mamba": ("MambaConfig", "MambaForCausalLM"),
               "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM"),
               "mamba2": ("Mamba2Config", "Mamba2ForCausalLM")}
    cfg_cls, model_cls = (getattr(tf, n) for n in classes[model_type])
    torch.manual_seed(seed)
    fields = {**TINY, **MOE_DEFAULTS.get(model_type, {}), **overrides}
    if model_type == "qwen3_5":  # (a multimodal file: the decoder in text_config)
        model = model_cls(cfg_cls(text_config=fields, vision_config=QWEN3_5_VISION))
    else:
        model = model_cls(cfg_cls(**fields))
    # Random init leaves norms at 1 and biases at 0; perturb them so loading bugs show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias inits to 0
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    return path


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                             attn_implementation="eager")
    return m.eval()


def make_worker(path: Path | str | None, num_blocks: int = 64, block_size: int = 4,
                num_cpu_blocks: int = 8, **kw: Any) -> Worker:
    w = Worker(WorkerConfig(model=None if path is None else str(path), block_size=block_size,
                            num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, **kw))
    w.load_model()
    w.init_kv_cache(w.determine_num_blocks())
    return w


class BlockAllocator:
    """Hands out shuffled block ids, so block tables are non-contiguous and interleaved;
    with ``groups`` > 1 (a hybrid model's KV cache groups) a table per group, all from
    the one pool, as the scheduler's ``HybridKVCacheManager`` gives them."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, groups: int = 1):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size
        self.groups = groups
        self.tables: dict[tuple[str, int], list[int]] = {}

    def table(self, rid: str, num_tokens: int, group: int = 0) -> list[int]:
        t = self.tables.setdefault((rid, group), [])
        while len(t) * self.block_size < num_tokens:
            t.append(self.free.pop())
        return list(t)


def request(alloc: BlockAllocator, rid: str, token_ids: list[int], computed: int,
            sample: bool = True, params: SamplingParams | None = None,
            sample_ids: list[str] | None = None) -> ScheduledRequest:
    """One scheduled row; greedy sampling unless ``params`` is given."""
    ids = sample_ids if sample_ids is not None else ([rid] if sample else [])
    p = params or SamplingParams(temperature=0.0)
    n = computed + len(token_ids)
    sr = ScheduledRequest(rid, list(token_ids), computed, alloc.table(rid, n), ids,
                          {i: p for i in ids})
    if alloc.groups > 1:
        sr.group_block_tables = [alloc.table(rid, n, g) for g in range(1, alloc.groups)]
    return sr


def plan(step: int, reqs: list[ScheduledRequest], **kw: Any) -> SchedulerOutput:
    return SchedulerOutput(step_id=step, scheduled=reqs, **kw)


@torch.inference_mode()
def all_logits(worker: Worker, p: SchedulerOutput) -> torch.Tensor:
    """Logits of every token of the plan (runs the forward, writes the KV cache)."""
    runner = worker.runner
    assert runner is not None
    runner.apply_cache_ops(p)
    inputs = runner.prepare_inputs(p)
    hidden = runner.forward_hidden(inputs)
    logits = worker.model.compute_logits(hidden)
    assert logits is not None
    return logits
