"""A random multi-token-prediction layer added to a DeepSeek-V3 checkpoint, laid out
as the releases carry it (tests and benchmarks of ``speculative_config`` method
"deepseek_mtp"; ``models.mtp``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_random_mtp_layer(model_dir: str | Path, seed: int = 0, weight_scale: float = 4.0
                         ) -> str:
    """Append layer ``num_hidden_layers`` to ``model_dir``'s (one-file) checkpoint: a
    random DeepSeek-V3 decoder layer (routed, as in the releases) with ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head.norm``, ``shared_head.head`` (the LM
    head's copy) and ``embed_tokens`` (the embedding's), and set
    ``num_nextn_predict_layers`` to 1; returns ``model_dir``."""
    import transformers as tf

    root = Path(model_dir)
    cfg = json.loads((root / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    torch.manual_seed(seed)
    bigger = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config.from_dict(
        {**cfg, "num_hidden_layers": n + 1}))
    with torch.no_grad():
        for p in bigger.parameters():
            if p.dim() >= 2:
                p.mul_(weight_scale)
            else:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in bigger.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    with tempfile.TemporaryDirectory() as scratch:
        bigger.save_pretrained(scratch, safe_serialization=True)
        extra = {k: v for k, v in load_file(str(Path(scratch) / "model.safetensors")).items()
                 if k.startswith(f"model.layers.{n}.")}
    tensors = load_file(str(root / "model.safetensors"))
    p = f"model.layers.{n}."
    g = torch.Generator().manual_seed(seed + 1)
    extra.update({
        p + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        p + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        p + "eh_proj.weight": 0.02 * weight_scale * torch.randn(h, 2 * h, generator=g),
        p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    })
    save_file({**tensors, **extra}, str(root / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(root)
