"""A random multi-token-prediction layer added to a DeepSeek-V3 checkpoint, laid out
as the releases carry it (tests and benchmarks of ``speculative_config`` method
"deepseek_mtp"; ``models.mtp``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

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


def write_guessing_mtp_model(dest: str | Path, tokenizer_dir: str | Path | None = None,
                             seed: int = 7, **overrides: Any) -> str:
    """A DeepSeek-V3 whose next token depends on its last token only, with an MTP layer
    that computes exactly that (``testing_eagle.write_guessing_pair``'s trick, for a
    layer that must normalise the embedding it reads); returns its path.

    The target's embeddings have unit RMS, its attention adds nothing (``o_proj``
    zero), its routed layers nothing (the experts' and shared expert's ``down_proj``
    zero) and its final norm weighs every channel 1: its stream is ``e + mlp(norm(e))``
    of the last token's embedding ``e`` (layer 0's dense MLP). The MTP layer's
    ``enorm`` then returns ``e`` itself, ``eh_proj`` passes it through and drops the
    hidden state, its attention and routed experts add nothing and its shared expert
    and norms are layer 0's MLP and norm: the same stream, read by a head equal to the
    LM head. Greedy guesses are all kept (barring float ties)."""
    from pagedserve.worker.testing import write_random_checkpoint

    width = 32
    path = Path(write_random_checkpoint(
        Path(dest), "deepseek_v3", tokenizer_dir, seed=seed, intermediate_size=width,
        moe_intermediate_size=width, n_shared_experts=1, first_k_dense_replace=1,
        **overrides))
    add_random_mtp_layer(path, seed=seed)
    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    w = load_file(str(path / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    emb /= emb.pow(2).mean(dim=1, keepdim=True).sqrt()
    w["model.norm.weight"].fill_(1.0)
    mtp = f"model.layers.{n}."
    for name, t in w.items():  # attention and routed layers add nothing to the stream
        if name.endswith(("self_attn.o_proj.weight", "shared_experts.down_proj.weight")) \
                or (".mlp.experts." in name and name.endswith("down_proj.weight")):
            t.zero_()
    for part in ("gate_proj", "up_proj", "down_proj"):
        w[f"{mtp}mlp.shared_experts.{part}.weight"] = \
            w[f"model.layers.0.mlp.{part}.weight"].clone()
    h = cfg["hidden_size"]
    w[mtp + "post_attention_layernorm.weight"] = \
        w["model.layers.0.post_attention_layernorm.weight"].clone()
    w[mtp + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    for norm in ("enorm", "shared_head.norm"):
        w[f"{mtp}{norm}.weight"] = torch.ones(h)
    w[mtp + "embed_tokens.weight"] = emb.clone()
    w[mtp + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)
