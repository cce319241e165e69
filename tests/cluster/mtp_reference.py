"""A dense DeepSeek-V3 MTP drafter, independent of the engine: the target's final
hidden states come from Hugging Face's model, the MTP block is Hugging Face's own
decoder layer (the checkpoint read as a model one layer deeper), and every guess
recomputes the whole sequence (vLLM's ``DeepSeekMultiTokenPredictorLayer``'s
equations: embedding zeroed at position 0, ``eh_proj`` over ``[enorm(embedding),
hnorm(hidden)]``, the layer, ``shared_head``)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file


class DenseMTP:
    """The first MTP layer of ``model_dir`` run densely in fp32."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        n = cfg["num_hidden_layers"]
        load = dict(dtype=torch.float32, attn_implementation="eager")
        self.target = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
        with tempfile.TemporaryDirectory() as deeper:
            (Path(deeper) / "config.json").write_text(json.dumps(
                {**cfg, "num_hidden_layers": n + 1}))
            os.symlink(Path(model_dir, "model.safetensors").resolve(),
                       Path(deeper) / "model.safetensors")
            bigger = AutoModelForCausalLM.from_pretrained(deeper, **load).eval()
        self.block, self.rotary = bigger.model.layers[n], bigger.model.rotary_emb
        w = load_file(str(Path(model_dir) / "model.safetensors"))
        p = f"model.layers.{n}."
        self.w = {k[len(p):]: v.float() for k, v in w.items() if k.startswith(p)}
        self.embed = w["model.embed_tokens.weight"].float()
        self.eps = cfg.get("rms_norm_eps", 1e-6)

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _run(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """The block's output at positions ``0..len(tokens)-1`` (token ``p + 1`` and
        feature ``p`` at position ``p``)."""
        n = len(tokens)
        e = self.embed[tokens].clone()
        e[0] = 0.0
        x = torch.cat([self._rms(e, "enorm.weight"), self._rms(features, "hnorm.weight")], -1)
        x = (x @ self.w["eh_proj.weight"].T)[None]
        cos, sin = self.rotary(x, torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_embeddings=(cos, sin))
        return (out[0] if isinstance(out, tuple) else out)[0]

    def propose(self, ids: list[int], k: int) -> list[int]:
        """``k`` greedy guesses after ``ids`` (ending with the token the target sampled)."""
        with torch.inference_mode():
            hidden = self.target.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
            tokens, feats, guesses = list(ids[1:]), list(hidden), []
            for _ in range(k):
                out = self._run(tokens, torch.stack(feats))[-1]
                logits = self._rms(out, "shared_head.norm.weight") \
                    @ self.w["shared_head.head.weight"].T
                guesses.append(int(logits.argmax()))
                tokens.append(guesses[-1])
                feats.append(out)
        return guesses
