"""Train an EAGLE head for the default model here, then decode with it: the acceptance
and speed a real head gives, side by side in one run on one machine against plain
decoding, n-gram lookup and Hugging Face ``generate`` (SmolLM2-135M-Instruct, fp32 on
CPU, greedy).

No trained head exists for SmolLM2, and nothing is downloaded, so this trains one as
the EAGLE authors do, shrunk to minutes on a CPU: the model answers chat prompts
built from topic and instruction templates (its own greedy answers: the text it
will be asked to guess), its last hidden states (after the final norm) are the
features, and a one-layer head learns to predict each next feature from the current
feature and the next token's embedding (smooth-L1 on features plus a weighted
cross-entropy of the model's own LM head on them, with noise on the input features,
as in the paper). The head is saved as the EAGLE authors' checkpoints are and served
with ``speculative_config={"method": "eagle"}``. It is then asked to guess answers to
prompts on topics it never saw in training.

The training code is its own dense PyTorch module: that the engine keeps its guesses
also checks that the engine's head computes what was trained.

    python bench/eagle_train.py --json bench/figures/eagle_train.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.nn.functional as F
from provenance import machine, tree_commit, write_figures  # sibling scripts
from safetensors.torch import save_file
from spec_decode import chat_ids
from torch import nn

TOPICS = ["the ocean", "volcanoes", "photosynthesis", "the moon", "honey bees", "rainbows",
          "the internet", "electricity", "dinosaurs", "the human heart", "coffee",
          "the Roman Empire", "glaciers", "solar panels", "chess", "the piano", "bread",
          "vaccines", "the printing press", "black holes", "recycling", "deserts",
          "earthquakes", "the stock market", "democracy", "penguins", "the Great Wall",
          "antibiotics", "wind turbines", "the Olympic Games", "tea", "airplanes",
          "the water cycle", "computers", "rain forests", "gravity", "mountains",
          "bicycles", "the brain", "music", "trains", "the Sahara", "clouds", "soil",
          "the sun", "whales", "cheese", "rockets", "libraries", "friendship",
          # held out: the evaluation asks about these only
          "lighthouses", "coral reefs", "the violin", "tornadoes", "chocolate",
          "submarines", "owls", "the Amazon river"]
HELD_OUT = 8
TEMPLATES = ["Explain {t} in simple terms.", "Write a short paragraph about {t}.",
             "What are three interesting facts about {t}?", "Why is {t} important?",
             "Describe {t} to a ten year old.", "Give a brief history of {t}.",
             "What are the pros and cons of {t}?", "Write a short poem about {t}.",
             "How does {t} affect everyday life?", "Write a short story involving {t}.",
             "What would the world be like without {t}?", "Summarize what you know about {t}.",
             "List five words that describe {t}.", "What do scientists study about {t}?",
             "Write a tweet about {t}.", "What are common misconceptions about {t}?"]


class DenseEagle(nn.Module):
    """EAGLE's head as ``models.eagle`` computes it (``fc`` over ``[embedding,
    feature]`` with a bias, one Llama layer without its input norm, the output read
    by the target's LM head), dense over padded batches, trainable."""

    def __init__(self, cfg: dict, embed: torch.Tensor) -> None:
        super().__init__()
        h, self.nh = cfg["hidden_size"], cfg["num_attention_heads"]
        self.nkv, self.d = cfg["num_key_value_heads"], cfg.get("head_dim") or h // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.theta = (cfg.get("rope_parameters") or {}).get("rope_theta") \
            or cfg.get("rope_theta", 10000.0)
        self.embed = embed  # (frozen: the target's, which is also its LM head)
        self.fc = nn.Linear(2 * h, h)
        self.q_proj = nn.Linear(h, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        i = cfg["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        for lin in (self.o_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2))

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        b, t, _ = feats.shape
        x = self.fc(torch.cat([F.embedding(ids, self.embed), feats], -1))
        q = self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        inv = 1.0 / self.theta ** (torch.arange(0, self.d, 2).float() / self.d)
        ang = torch.outer(torch.arange(t).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def rot(z: torch.Tensor) -> torch.Tensor:
            return torch.cat([-z[..., self.d // 2:], z[..., :self.d // 2]], -1)

        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        rep = self.nh // self.nkv
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
        s = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.eps)
        n = self.post_attention_layernorm * n
        return s + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The weights under the EAGLE authors' names."""
        p = "layers.0."
        out = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias,
               p + "post_attention_layernorm.weight": self.post_attention_layernorm}
        for m in ("q", "k", "v", "o"):
            out[f"{p}self_attn.{m}_proj.weight"] = getattr(self, f"{m}_proj").weight
        for m in ("gate", "up", "down"):
            out[f"{p}mlp.{m}_proj.weight"] = getattr(self, f"{m}_proj").weight
        return {k: v.detach().contiguous() for k, v in out.items()}


def features(model, seqs: list[list[int]], batch: int = 16) -> list[torch.Tensor]:
    """The model's last hidden states (after its final norm) of each sequence."""
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for i in range(0, len(seqs), batch):
            part = seqs[i:i + batch]
            n = max(map(len, part))
            ids = torch.tensor([s + [0] * (n - len(s)) for s in part])
            mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in part])
            h = model.model(ids, attention_mask=mask).last_hidden_state
            out += [h[j, :len(s)].clone() for j, s in enumerate(part)]
    return out


def train(head: DenseEagle, seqs: list[list[int]], feats: list[torch.Tensor], minutes: float,
          batch: int, ce_weight: float, noise: float, lr: float, ce_rows: int = 256) -> dict:
    """Teacher-forced training: row ``p`` sees token ``p + 1`` and the feature of ``p``
    (plus noise), and predicts the feature of ``p + 1`` and the token ``p + 2``."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    end = time.perf_counter() + 60 * minutes
    steps, losses = 0, []
    while time.perf_counter() < end:
        pick = torch.randint(len(seqs), (batch,), generator=g).tolist()
        n = max(len(seqs[i]) for i in pick) - 1
        ids = torch.zeros(batch, n, dtype=torch.long)
        f_in = torch.zeros(batch, n, feats[0].shape[1])
        f_out = torch.zeros_like(f_in)
        tok = torch.full((batch, n), -100, dtype=torch.long)
        valid = torch.zeros(batch, n, dtype=torch.bool)
        for r, i in enumerate(pick):
            s, f = seqs[i], feats[i]
            m = len(s) - 1
            ids[r, :m] = torch.tensor(s[1:])
            f_in[r, :m] = f[:m]
            f_out[r, :m - 1] = f[1:m]
            valid[r, :m - 1] = True
            tok[r, :m - 2] = torch.tensor(s[2:m])
        f_in = f_in + noise * torch.randn(f_in.shape, generator=g) * f_in.std()
        frac = min(1.0, (steps + 1) / 20)
        left = max(0.0, (end - time.perf_counter()) / (60 * minutes))
        for group in opt.param_groups:
            group["lr"] = lr * frac * (0.1 + 0.9 * left)
        out = head(ids, f_in)
        reg = F.smooth_l1_loss(out[valid], f_out[valid])
        # The token loss on a sample of rows: the 49,152-wide head dominates the step.
        rows = (tok.view(-1) >= 0).nonzero().squeeze(1)
        rows = rows[torch.randperm(len(rows), generator=g)[:ce_rows]]
        logits = out.reshape(-1, out.shape[-1])[rows] @ head.embed.T
        ce = F.cross_entropy(logits, tok.view(-1)[rows])
        loss = reg + ce_weight * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        steps += 1
        losses.append((reg.item(), ce.item()))
        if steps % 50 == 0:
            print(f"  step {steps}: feature loss {reg:.4f}, token loss {ce:.3f}", flush=True)
    return {"steps": steps, "final_feature_loss": losses[-1][0],
            "final_token_loss": losses[-1][1]}


def heldout_top1(head: DenseEagle, seqs: list[list[int]], feats: list[torch.Tensor],
                 prompt_lens: list[int]) -> float:
    """How often the head's first guess (from the model's own features, as the
    engine's first guess of a step is) is the model's next token, over the answers
    to the held-out prompts (from their second token: the first is sampled): what
    the engine's first guesses should keep."""
    hit = total = 0
    with torch.inference_mode():
        for s, f, n in zip(seqs, feats, prompt_lens):
            out = head(torch.tensor([s[1:]]), f[None, :-1])[0]
            guess = (out[n - 1:-1] @ head.embed.T).argmax(-1)
            hit += int((guess == torch.tensor(s[n + 1:])).sum())
            total += len(s) - n - 1
    return hit / max(total, 1)


def run(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from pagedserve.cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-minutes", type=float, default=10.0)
    ap.add_argument("--answer-tokens", type=int, default=160)
    ap.add_argument("--num-train-prompts", type=int, default=None, help="(all: 800)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--head-dir", default=None, help="where to save the head (a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    commit = tree_commit()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.cluster import LLM, SamplingParams
    from pagedserve.worker.loaders import resolve_model

    path = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = json.loads((Path(path) / "config.json").read_text())
    train_prompts = chat_ids(tok, [t.format(t=x) for x in TOPICS[:-HELD_OUT]
                                   for t in TEMPLATES])[:args.num_train_prompts]
    eval_prompts = chat_ids(tok, [TEMPLATES[i % len(TEMPLATES)].format(t=x)
                                  for i, x in enumerate(TOPICS[-HELD_OUT:])])
    t0 = time.perf_counter()
    llm = LLM(model=None, dtype="float32")
    try:
        answers = llm.generate(train_prompts, SamplingParams(
            temperature=0.0, max_tokens=args.answer_tokens), use_tqdm=False)
        plain_tps, plain_out = run(llm, eval_prompts, args.max_tokens)
    finally:
        llm.shutdown()
    seqs = [p + a.outputs[0].token_ids for p, a in zip(train_prompts, answers)]
    print(f"{len(seqs)} training answers, {sum(map(len, seqs))} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    feats = features(model, seqs)
    eval_seqs = [p + o for p, o in zip(eval_prompts, plain_out)]
    eval_feats = features(model, eval_seqs)
    print(f"features in {time.perf_counter() - t0:.0f} s", flush=True)
    embed = model.model.embed_tokens.weight.detach()
    hf_t0 = time.perf_counter()
    hf_tokens = 0
    with torch.inference_mode():
        for p in eval_prompts:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=args.max_tokens, pad_token_id=2)
            hf_tokens += y.shape[1] - len(p)
    hf_tps = hf_tokens / (time.perf_counter() - hf_t0)
    del model
    torch.manual_seed(0)
    head = DenseEagle(cfg, embed)
    stats = train(head, seqs, feats, args.train_minutes, args.batch, args.ce_weight,
                  args.noise, args.lr)
    stats["heldout_top1"] = heldout_top1(head, eval_seqs, eval_feats,
                                         [len(p) for p in eval_prompts])
    print(f"held-out answers, teacher-forced: the head's top guess is the model's next "
          f"token {stats['heldout_top1']:.0%} of the time", flush=True)
    head_dir = Path(args.head_dir or tempfile.mkdtemp())
    head_dir.mkdir(parents=True, exist_ok=True)
    save_file(head.checkpoint(), str(head_dir / "model.safetensors"), metadata={"format": "pt"})
    (head_dir / "config.json").write_text(json.dumps(
        {**cfg, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"],
         "tie_word_embeddings": False}, indent=2))
    rows = {"plain": {"tok_s": plain_tps}, "hf_generate": {"tok_s": hf_tps}}
    k = args.num_speculative_tokens
    agree = True
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("eagle", {"method": "eagle", "model": str(head_dir),
                                  "num_speculative_tokens": k})):
        llm = LLM(model=None, dtype="float32", speculative_config=spec)
        try:
            tps, out = run(llm, eval_prompts, args.max_tokens)
            s = llm.engine.get_stats()["spec_decode"]
        finally:
            llm.shutdown()
        agree &= out == plain_out
        kept = s["num_accepted_tokens"] / max(s["num_draft_tokens"], 1)
        per_step = 1 + s["num_accepted_tokens"] / max(s["num_drafts"], 1)
        rows[name] = {"tok_s": tps, "kept": kept, "tokens_per_drafted_step": per_step,
                      "kept_by_position": [a / max(d, 1) for a, d in zip(
                          s["num_accepted_tokens_per_pos"], s["num_draft_tokens_per_pos"])]}
    for name, row in rows.items():
        extra = (f"   kept {row['kept']:.0%}, {row['tokens_per_drafted_step']:.2f} tokens a "
                 "drafted step" if "kept" in row else "")
        print(f"{name:12s} {row['tok_s']:7.1f} tok/s{extra}")
    ratios = {"eagle_over_plain": rows["eagle"]["tok_s"] / plain_tps,
              "eagle_over_ngram": rows["eagle"]["tok_s"] / rows["ngram"]["tok_s"],
              "eagle_over_hf_generate": rows["eagle"]["tok_s"] / hf_tps}
    for key, v in ratios.items():
        print(f"{key:24s} {v:5.2f}x")
    print(f"kept by guess position: {[round(x, 2) for x in rows['eagle']['kept_by_position']]}")
    print(f"greedy tokens equal plain decoding's: {agree}   ({machine()}, {commit})")
    if args.json:
        write_figures(args.json, args, commit, training=stats, rows=rows, ratios=ratios,
                      tokens_agree=agree, train_tokens=sum(map(len, seqs)))


if __name__ == "__main__":
    main()
