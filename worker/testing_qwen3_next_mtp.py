"""A multi-token-prediction module added to a random Qwen3-Next checkpoint, laid out
as the releases carry it (``mtp.*``; tests and benchmarks of ``speculative_config``
method "qwen3_next_mtp", ``models.qwen3_next_mtp``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def add_random_qwen3_next_mtp(model_dir: str | Path, seed: int = 0,
                              weight_scale: float = 4.0) -> str:
    """Add to ``model_dir``'s (one-file) Qwen3-Next or Qwen3.5 checkpoint an MTP module:
    a copy of its last attention layer, each tensor jittered (the layout transformers
    wrote for the decoder, under ``mtp.layers.0.``), ``mtp.fc`` and its three norms;
    returns ``model_dir``."""
    root = Path(model_dir)
    tensors = load_file(str(root / "model.safetensors"))
    decoder = "model.language_model." if any(
        k.startswith("model.language_model.") for k in tensors) else "model."
    attends = sorted(int(k[len(decoder) + 7:].split(".")[0]) for k in tensors
                     if k.startswith(decoder + "layers.") and k.endswith("self_attn.q_proj.weight"))
    layer = f"{decoder}layers.{attends[-1]}."
    g = torch.Generator().manual_seed(seed)
    extra = {"mtp.layers.0." + k[len(layer):]:
             v + 0.5 * v.float().std().clamp_min(0.1) * torch.randn(v.shape, generator=g)
             for k, v in tensors.items() if k.startswith(layer)}
    h = tensors[decoder + "embed_tokens.weight"].shape[1]
    extra["mtp.fc.weight"] = 0.02 * weight_scale * torch.randn(h, 2 * h, generator=g)
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):  # (1 + w) offsets
        extra[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=g)
    save_file({**tensors, **extra}, str(root / "model.safetensors"), metadata={"format": "pt"})
    return str(root)


def write_guessing_qwen3_next_mtp_model(dest: str | Path,
                                        tokenizer_dir: str | Path | None = None,
                                        seed: int = 7, **overrides: Any) -> str:
    """A Qwen3-Next whose next token depends on its last token only, with an MTP module
    that computes exactly that (``testing_mtp.write_guessing_mtp_model``'s trick);
    returns its path.

    The embeddings have unit RMS; every DeltaNet and attention output projection is
    zero and so is every MLP's ``down_proj`` but layer 0's, so the stream is ``e +
    mlp_0(norm(e))`` of the last token's embedding ``e``. The MTP module's
    ``pre_fc_norm_embedding`` (offset 0) returns ``e`` itself, ``fc`` passes it through
    and drops the hidden state, its attention adds nothing, its MLP and norms are
    layer 0's and its final norm the decoder's: the same stream, read by the same LM
    head. Greedy guesses are all kept (barring float ties)."""
    from pagedserve.worker.testing import write_random_checkpoint

    path = Path(write_random_checkpoint(Path(dest), "qwen3_next", tokenizer_dir, seed=seed,
                                        **overrides))
    add_random_qwen3_next_mtp(path, seed=seed)
    h = json.loads((path / "config.json").read_text())["hidden_size"]
    w = load_file(str(path / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    emb /= emb.pow(2).mean(dim=1, keepdim=True).sqrt()
    for name, t in w.items():  # mixers and every MLP but layer 0's add nothing
        if name.endswith(("out_proj.weight", "o_proj.weight")) or (
                ".mlp." in name and "down_proj" in name
                and not name.startswith("model.layers.0.")):
            t.zero_()
    first = "model.layers.0."
    for name in [k for k in w if k.startswith(first + "mlp.")]:
        w["mtp.layers.0." + name[len(first):]] = w[name].clone()
    w["mtp.layers.0.post_attention_layernorm.weight"] = \
        w[first + "post_attention_layernorm.weight"].clone()
    w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    w["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    w["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)
