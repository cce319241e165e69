"""A dense EAGLE / EAGLE-3 drafter written from the papers' equations, independent of
the engine: the target's features come from Hugging Face's model, the head runs as
plain matrix products over the whole sequence, and every guess recomputes it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def target_features(target_dir: str, ids: list[int], aux: list[int] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``(final hidden states after the norm, the three layers' inputs side by
    side or an empty tensor)`` of ``ids``, one row per token, and its LM head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, args, kw, i=i: inputs.__setitem__(i, (args[0] if args else
                                                         kw["hidden_states"])[0]),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            final = model.model(torch.tensor([ids])).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    joined = torch.cat([inputs[i] for i in aux], -1) if aux else final[:, :0]
    return final, joined


class DenseHead:
    """The head of a checkpoint directory, run densely in fp32."""

    def __init__(self, head_dir: str, target_dir: str, method: str) -> None:
        self.method = method
        raw = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v.float()
               for k, v in load_file(str(Path(head_dir) / "model.safetensors")).items()
               if k != "t2d"}
        self.w = raw
        self.cfg = json.loads((Path(head_dir) / "config.json").read_text())
        target = {k: v.float() for k, v in
                  load_file(str(Path(target_dir) / "model.safetensors")).items()}
        tcfg = json.loads((Path(target_dir) / "config.json").read_text())
        self.embed = target["model.embed_tokens.weight"]
        self.target_head = target.get("lm_head.weight", self.embed)
        self.eps = self.cfg.get("rms_norm_eps", 1e-6)
        self.theta = tcfg.get("rope_theta") or (tcfg.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0)
        self.heads = self.cfg["num_attention_heads"]
        self.kv = self.cfg.get("num_key_value_heads", self.heads)
        self.d = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.heads

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        n, p, d = x.shape[0], "layers.0.self_attn.", self.d
        q = (x @ self.w[p + "q_proj.weight"].T).view(n, self.heads, d)
        k = (x @ self.w[p + "k_proj.weight"].T).view(n, self.kv, d)
        v = (x @ self.w[p + "v_proj.weight"].T).view(n, self.kv, d)
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2).float() / d)
        ang = torch.outer(torch.arange(n).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

        def rot(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)

        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1).reshape(n, -1) @ self.w[p + "o_proj.weight"].T

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        p = "layers.0.mlp."
        return (F.silu(x @ self.w[p + "gate_proj.weight"].T) * (x @ self.w[p + "up_proj.weight"].T)
                ) @ self.w[p + "down_proj.weight"].T

    def forward(self, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits over the target's vocabulary, next features)`` at every row."""
        e = self.embed[torch.tensor(ids)]
        if self.method == "eagle":
            x = torch.cat([e, feats], -1) @ self.w["fc.weight"].T
            if "fc.bias" in self.w:
                x = x + self.w["fc.bias"]
            s = x + self._attention(x)
            out = s + self._mlp(self._norm(s, "layers.0.post_attention_layernorm.weight"))
            return out @ self.target_head.T, out
        x = torch.cat([self._norm(e, "layers.0.input_layernorm.weight"),
                       self._norm(feats, "layers.0.hidden_norm.weight")], -1)
        s = feats + self._attention(x)
        pre = s + self._mlp(self._norm(s, "layers.0.post_attention_layernorm.weight"))
        small = self._norm(pre, "norm.weight") @ self.w["lm_head.weight"].T
        full = torch.full((len(ids), self.embed.shape[0]), float("-inf"))
        rows = small.shape[1]
        full[:, torch.arange(rows) + self.w["d2t"].long()] = small
        return full, pre

    def propose(self, target_dir: str, seq: list[int], k: int,
                aux: list[int] | None) -> list[int]:
        """The ``k`` greedy guesses after ``seq`` (whose last token was just sampled)."""
        final, joined = target_features(target_dir, seq[:-1], aux)
        feats = final if self.method == "eagle" else joined @ self.w["fc.weight"].T
        ids = list(seq[1:])
        guesses: list[int] = []
        for _ in range(k):
            logits, nxt = self.forward(ids, feats)
            g = int(logits[-1].argmax())
            guesses.append(g)
            ids.append(g)
            feats = torch.cat([feats, nxt[-1:]])
        return guesses
