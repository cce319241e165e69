"""Encoder embedding throughput: pagedserve ``LLM.embed`` against Hugging Face.

Same machine, same random encoder, same inputs, one run: ``--num-inputs``
prompts of ``--min-len`` to ``--max-len`` token ids, ``[CLS]`` pooling,
L2-normalised. ``--family`` picks the encoder (fp32 on CPU):

- ``bert``: bge-small-en-v1.5's shape (12 layers, hidden 384, 12 heads, 512
  positions, 33M parameters);
- ``modernbert``: ModernBERT-base's (gte-modernbert-base, modernbert-embed-base:
  22 layers, hidden 768, 12 heads, GeGLU 1,152, local layers seeing 64 tokens
  each side, 8,192 positions; 149M parameters), by default over longer prompts
  (``--min-len 256 --max-len 2048``, 24 inputs) where its local layers matter;
- ``splade``: splade-v3's (BERT-base masked LM, 110M parameters, 30,522-wide
  sparse vectors), 64 inputs, against ``AutoModelForMaskedLM`` with SPLADE's
  max pooling done as sentence-transformers' ``SparseEncoder`` does;
- ``colbert``: colbertv2.0's (BERT-base, a 128-wide projection), a rerank: the
  first input is the query, the other 63 its documents, scored by MaxSim over
  unit token vectors (``LLM.encode`` then ``late_interaction.pair_score``; HF:
  ``AutoModel``, the projection, normalised, masked, MaxSim in one batch).

- pagedserve: every input submitted at once; each step packs up to
  ``--max-num-batched-tokens`` tokens of whole prompts, the projections run
  over the real tokens only and attention pads to the longest prompt of each
  group of similar lengths (a local layer attends in chunks of its band);
- Hugging Face: ``AutoModel`` forwards over batches of ``--hf-batch`` inputs
  sorted by length (as sentence-transformers' ``encode`` does, so padding is
  small), right-padded with an attention mask (SDPA; its local layers mask the
  full square to a band).

Prints inputs/s and tokens/s of each, the ratio, and the largest difference
between the two sets of embeddings.

    python bench/encoders.py
    python bench/encoders.py --family modernbert
    python bench/encoders.py --family splade
    python bench/encoders.py --family colbert
    python bench/encoders.py --json bench/figures/encoders.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from embed import (  # (the decoder embedding benchmark)
    report,
    run_hf,
    run_pagedserve,
    sorted_batches,
)

BGE_SMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512)
MODERNBERT_BASE = dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                       intermediate_size=1152, max_position_embeddings=8192,
                       local_attention=128)
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
# family -> (shape, title, default (num_inputs, min_len, max_len, hf_batch))
FAMILIES = {
    "bert": (BGE_SMALL, "random bge-small-shaped BERT", (256, 16, 256, 32)),
    "modernbert": (MODERNBERT_BASE, "random ModernBERT-base-shaped encoder",
                   (24, 256, 2048, 8)),
    "splade": (BERT_BASE, "random splade-v3-shaped SPLADE (BERT-base masked LM)",
               (64, 16, 256, 8)),
    "colbert": (BERT_BASE, "random colbertv2.0-shaped ColBERT (BERT-base, 128-wide)",
                (64, 16, 256, 8)),
}


def run_pagedserve_colbert(path: str, inputs: list[list[int]], step_tokens: int
                           ) -> tuple[float, torch.Tensor]:
    """Our time and MaxSim scores of inputs 1.. against input 0: every input's token
    vectors through ``LLM.encode``, then the scores."""
    from pagedserve.cluster import LLM
    from pagedserve.cluster.late_interaction import pair_score

    llm = LLM(model=path, max_num_seqs=256, max_num_batched_tokens=step_tokens)
    try:
        llm.encode(inputs[:4], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        vecs = [o.outputs.data for o in llm.encode(inputs, use_tqdm=False)]
        scores = torch.tensor([pair_score(vecs[0], d) for d in vecs[1:]])
        return time.perf_counter() - t0, scores
    finally:
        llm.shutdown()


def run_hf_colbert(path: str, inputs: list[list[int]], batch: int
                   ) -> tuple[float, torch.Tensor]:
    """HF's time and MaxSim scores: ``AutoModel`` over length-sorted padded batches, the
    projection, unit rows, padding masked out of the document side."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    proj = load_file(f"{path}/model.safetensors")["linear.weight"]
    vecs: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    with torch.inference_mode():
        model(torch.tensor([inputs[0]]))  # warm-up
        t0 = time.perf_counter()
        for idx, ids, mask in sorted_batches(inputs, batch):
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            rows = torch.nn.functional.normalize(hidden @ proj.T, dim=-1)
            for r, i in enumerate(idx):
                vecs[i] = rows[r, : len(inputs[i])]
        q = vecs[0]
        scores = torch.stack([(q @ d.T).amax(-1).sum() for d in vecs[1:]])
        dt = time.perf_counter() - t0
    return dt, scores



def run_hf_splade(path: str, inputs: list[list[int]], batch: int
                  ) -> tuple[float, torch.Tensor]:
    """HF's time and SPLADE vectors: ``AutoModelForMaskedLM`` over length-sorted padded
    batches, ``log1p(relu(logits))`` masked and max-pooled, as sentence-transformers'
    ``SparseEncoder`` computes them."""
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(path, dtype=torch.float32).eval()
    out = torch.empty(len(inputs), model.config.vocab_size)
    with torch.inference_mode():
        model(torch.tensor([inputs[0]]))  # warm-up
        t0 = time.perf_counter()
        for idx, ids, mask in sorted_batches(inputs, batch):
            logits = model(input_ids=ids, attention_mask=mask).logits
            scores = torch.log1p(torch.relu(logits)) * mask.unsqueeze(-1)
            out[idx] = scores.amax(1)
        dt = time.perf_counter() - t0
    return dt, out


def make_inputs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``[CLS] words [SEP]`` id lists (ids 2 and 3 in ``testing_encoders``' vocabulary)."""
    rng = random.Random(seed)
    return [[2, *(rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi) - 2)), 3]
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="bert")
    ap.add_argument("--num-inputs", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--hf-batch", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    shape, title, defaults = FAMILIES[args.family]
    for name, value in zip(("num_inputs", "min_len", "max_len", "hf_batch"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    from pagedserve.worker.testing_encoders import write_random_encoder

    vocab = 50368 if args.family == "modernbert" else 30522
    splade = args.family == "splade"
    step = max(args.max_num_batched_tokens, args.max_len)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = make_inputs(args.num_inputs, args.min_len, args.max_len, vocab, args.seed)
        if args.family == "colbert":
            from pagedserve.worker.testing_encoders import write_random_multi_vector

            path = write_random_multi_vector(tmp, "colbert", dim=128, words=vocab - 5,
                                             **shape)
            report(f"{title} fp32, a rerank of {len(inputs) - 1} documents", inputs, args,
                   run_pagedserve_colbert(path, inputs, step),
                   run_hf_colbert(path, inputs, args.hf_batch), "HF AutoModel + MaxSim",
                   "pagedserve LLM.encode + MaxSim")
            return
        path = write_random_encoder(tmp, "bert" if splade else args.family, words=vocab - 5,
                                    splade="max" if splade else None, **shape)
        ours = run_pagedserve(path, inputs, step)
        if splade:
            report(f"{title} fp32, max pooling", inputs, args, ours,
                   run_hf_splade(path, inputs, args.hf_batch), "HF AutoModelForMaskedLM")
        else:
            report(f"{title} fp32, [CLS] pooling", inputs, args, ours,
                   run_hf(path, inputs, args.hf_batch, pool="cls"))


if __name__ == "__main__":
    main()
