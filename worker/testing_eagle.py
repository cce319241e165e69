"""Random EAGLE / EAGLE-3 heads for tests and benchmarks, written as their authors
publish them (bare tensor names, EAGLE-3's layer as ``midlayer``, ``d2t`` / ``t2d``),
and a target-and-head pair whose head guesses exactly what the target will say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedserve.worker.testing import write_random_checkpoint


def write_random_eagle(dest: str | Path, target_dir: str | Path, method: str = "eagle",
                       seed: int = 0, draft_vocab: int | None = None, fc_bias: bool = True,
                       aux_layers: list[int] | None = None, scale: float = 1.0,
                       safetensors: bool = True, **overrides: Any) -> str:
    """Save a random head for the checkpoint at ``target_dir``; return its path.

    ``method``: "eagle" (``fc`` over ``[embedding, feature]``, a layer without an input
    norm, the checkpoint repeating the target's embedding as released heads do) or
    "eagle3" (``fc`` over three layers' inputs, ``midlayer`` reading
    ``[norm(embedding), norm(feature)]``, a final norm and its own LM head over
    ``draft_vocab`` ids, mapped by ``d2t``). ``aux_layers`` goes to its
    ``eagle_config``; ``safetensors=False`` writes ``pytorch_model.bin``, as most
    released heads are; ``overrides`` are config fields."""
    if method not in ("eagle", "eagle3"):
        raise ValueError(f"method must be 'eagle' or 'eagle3', got {method!r}")
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads = target["num_attention_heads"]
    kv = target.get("num_key_value_heads", heads)
    d = target.get("head_dim") or h // heads
    inter = target["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5 * 4

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    width = 2 * h if method == "eagle3" else h
    layer = {"self_attn.q_proj.weight": rand(heads * d, width),
             "self_attn.k_proj.weight": rand(kv * d, width),
             "self_attn.v_proj.weight": rand(kv * d, width),
             "self_attn.o_proj.weight": rand(h, heads * d),
             "post_attention_layernorm.weight": norm(),
             "mlp.gate_proj.weight": rand(inter, h), "mlp.up_proj.weight": rand(inter, h),
             "mlp.down_proj.weight": rand(h, inter)}
    config = {k: v for k, v in target.items() if k not in ("architectures", "auto_map")}
    config.update(num_hidden_layers=1, tie_word_embeddings=False, **overrides)
    if method == "eagle":
        tensors = {f"layers.0.{k}": v for k, v in layer.items()}
        tensors["fc.weight"] = rand(h, 2 * h)
        if fc_bias:
            tensors["fc.bias"] = 0.1 * torch.randn(h, generator=g)
        tensors["embed_tokens.weight"] = _target_tensor(target_dir, "model.embed_tokens.weight")
        config["architectures"] = ["LlamaForCausalLM"]
    else:
        rows = draft_vocab or vocab
        tensors = {f"midlayer.{k}": v for k, v in layer.items()}
        tensors.update({"midlayer.input_layernorm.weight": norm(),
                        "midlayer.hidden_norm.weight": norm(), "norm.weight": norm(),
                        "fc.weight": rand(h, 3 * h), "lm_head.weight": rand(rows, h)})
        ids = torch.sort(torch.randperm(vocab, generator=g)[:rows]).values
        tensors["d2t"] = ids - torch.arange(rows)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=rows)
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    return _save(dest, config, tensors, safetensors)


def write_guessing_pair(dest: str | Path, tokenizer_dir: str | Path | None = None,
                        seed: int = 7, num_layers: int = 1, **overrides: Any
                        ) -> tuple[str, str]:
    """A target whose next token depends on its last token only, and an EAGLE head
    that computes exactly that; returns ``(target, head)`` paths.

    The target's attention adds nothing (``o_proj`` is zero), layers after the first
    add nothing at all (``down_proj`` too: ``num_layers`` only spreads it over
    pipeline stages), and its final norm weighs
    every channel 1, so its stream is ``e + mlp(norm(e))`` of the last token's
    embedding ``e`` and its argmax that of the stream itself. The head's ``fc`` passes
    the embedding through, its own attention adds nothing, and it holds the target's
    MLP and norm: its output is the same stream, and the target's LM head reads the
    same argmax from it. Greedy guesses are then all kept (barring float ties), which
    tests everything around the head but its features."""
    dest = Path(dest)
    target = write_random_checkpoint(dest / "target", "llama", tokenizer_dir, seed=seed,
                                     num_hidden_layers=num_layers, **overrides)
    weights = load_file(str(Path(target) / "model.safetensors"))
    for i in range(num_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        if i:
            weights[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    weights["model.norm.weight"].fill_(1.0)
    save_file(weights, str(Path(target) / "model.safetensors"), metadata={"format": "pt"})
    head_dir = write_random_eagle(dest / "head", target, "eagle", seed=seed, fc_bias=False)
    head = load_file(str(Path(head_dir) / "model.safetensors"))
    h = head["fc.weight"].shape[0]
    head["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    head["layers.0.self_attn.o_proj.weight"].zero_()
    for name in ("post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"):
        head[f"layers.0.{name}"] = weights[f"model.layers.0.{name}"].clone()
    save_file(head, str(Path(head_dir) / "model.safetensors"), metadata={"format": "pt"})
    return target, head_dir


def _target_tensor(target_dir: str | Path, name: str) -> torch.Tensor:
    from pagedserve.worker.loaders import iter_safetensors

    for n, lazy in iter_safetensors(target_dir):
        if n == name:
            return lazy[:].clone()
    raise KeyError(f"{name} not in {target_dir}")


def _save(dest: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
          safetensors: bool = True) -> str:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if safetensors:
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(tensors, dest / "pytorch_model.bin")
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return str(dest)

