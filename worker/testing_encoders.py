"""Random BERT-family (and ModernBERT) checkpoints with a WordPiece tokenizer, for tests
and benchmarks.

transformers writes them (``BertModel``, ``XLMRobertaForSequenceClassification``...)
and the engine loads them through its real loader, so a comparison against
transformers on the same directory checks the whole path. Words are ``w0`` ..
``w{n}``; RoBERTa-style files use ``<s>`` / ``</s>`` / ``<pad>`` (ids 0-2) as
their separators and padding, BERT-style and ModernBERT ones ``[CLS]`` / ``[SEP]`` /
``[PAD]``.
An optional sentence-transformers ``modules.json`` + ``1_Pooling`` names the
pooling. Needs ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
_ST_FLAGS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "last": "pooling_mode_lasttoken"}


def _write_tokenizer(dest: Path, specials: tuple[str, ...], words: int,
                     token_types: bool = True) -> None:
    """WordPiece over ``specials`` + ``w0..w{words-1}`` with the family's pair template
    (BERT: ``[CLS] a [SEP] b [SEP]``, the second text token type 1; RoBERTa:
    ``<s> a </s></s> b </s>``, one token type); without ``token_types`` (ModernBERT,
    whose model takes none) the tokenizer returns no token type ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*specials, *(f"w{i}" for i in range(words))])}
    bert = specials == BERT_SPECIALS
    pad, unk, cls, sep, mask = specials if bert else (specials[1], specials[3], specials[0],
                                                       specials[2], specials[4])
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    pair = f"{cls} $A {sep} $B:1 {sep}:1" if bert else f"{cls} $A {sep} {sep} $B {sep}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair,
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk,
                            cls_token=cls, sep_token=sep, mask_token=mask,
                            model_max_length=64, model_input_names=[
                                "input_ids", *(["token_type_ids"] if token_types else []),
                                "attention_mask"]).save_pretrained(dest)


def write_sentence_transformers_pooling(dest: str | Path, pooling: str,
                                        hidden_size: int) -> None:
    """sentence-transformers' ``modules.json`` and ``1_Pooling/config.json``."""
    dest = Path(dest)
    (dest / "1_Pooling").mkdir(exist_ok=True)
    (dest / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    flags = {flag: flag == _ST_FLAGS[pooling] for flag in _ST_FLAGS.values()}
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden_size, **flags}))


def write_splade_modules(dest: str | Path, strategy: str) -> None:
    """sentence-transformers' ``SparseEncoder`` files: ``MLMTransformer`` then
    ``SpladePooling`` with ``strategy``."""
    dest = Path(dest)
    (dest / "1_SpladePooling").mkdir(exist_ok=True)
    (dest / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "",
         "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.models.SpladePooling"}]))
    (dest / "1_SpladePooling" / "config.json").write_text(json.dumps(
        {"pooling_strategy": strategy, "activation_function": "relu"}))


def write_random_encoder(dest: str | Path, family: str = "bert", num_labels: int | None = None,
                         pooling: str | None = None, seed: int = 0, words: int = 120,
                         per_token: bool = False, splade: str | None = None,
                         **overrides: Any) -> str:
    """A random ``family`` ("bert", "roberta", "xlm-roberta", "modernbert") encoder in
    ``dest``: a base model, or with ``num_labels`` a sequence classifier (a token
    classifier with ``per_token``, a SPLADE masked-LM file with ``splade``, its
    pooling strategy); ``pooling`` adds a sentence-transformers pooling config.
    Returns the directory.

    The ModernBERT has three layers (global, local, local) whose local window of 8
    (4 positions each side) is far shorter than the test prompts."""
    import transformers

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    specials = ROBERTA_SPECIALS if family in ("roberta", "xlm-roberta") else BERT_SPECIALS
    cfg_cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig,
               "xlm-roberta": transformers.XLMRobertaConfig,
               "modernbert": transformers.ModernBertConfig}[family]
    kw: dict[str, Any] = dict(vocab_size=len(specials) + words, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=80)
    if family in ("roberta", "xlm-roberta"):  # positions after the padding index; one type
        kw.update(pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  max_position_embeddings=82, type_vocab_size=1)
    elif family == "modernbert":  # ([PAD], [CLS], [SEP] are ids 0, 2, 3)
        kw.update(num_hidden_layers=3, local_attention=8,
                  pad_token_id=0, bos_token_id=2, cls_token_id=2, eos_token_id=3,
                  sep_token_id=3)
    if num_labels is not None:
        kw["num_labels"] = num_labels
    cfg = cfg_cls(**{**kw, **overrides})
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta",
              "modernbert": "ModernBert"}[family]
    suffix = "ForMaskedLM" if splade else "Model" if num_labels is None else \
        "ForTokenClassification" if per_token else "ForSequenceClassification"
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + suffix)(cfg).eval()
    with torch.no_grad():  # (spread the init's 0.02 std so prompts differ clearly)
        for name, p in model.named_parameters():
            if p.dim() == 2 and "LayerNorm" not in name:
                p.normal_(0.0, 0.15)
            elif p.dim() == 1 and family == "modernbert" and "norm" in name:
                p.normal_(1.0, 0.2)  # (its norms' weights, else all ones)
    model.save_pretrained(dest)
    _write_tokenizer(dest, specials, words, token_types=family != "modernbert")
    if pooling is not None:
        write_sentence_transformers_pooling(dest, pooling, cfg.hidden_size)
    if splade is not None:
        write_splade_modules(dest, splade)
    return str(dest)


def hf_splade_vectors(path: str | Path, inputs: list[Any], strategy: str = "max"
                      ) -> list[torch.Tensor]:
    """SPLADE's vectors by transformers' masked-LM logits on each input alone:
    ``log1p(relu(logits))`` pooled over the tokens, as sentence-transformers does."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForMaskedLM.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for x in inputs:
            enc = {"input_ids": torch.tensor([x])} if isinstance(x, list) else \
                tok(x, return_tensors="pt")
            scores = torch.log1p(torch.relu(model(**enc).logits[0]))
            out.append(scores.amax(0) if strategy == "max" else scores.sum(0))
    return out


def hf_encoder_outputs(path: str | Path, inputs: list[Any], classifier: bool = False,
                       per_token: bool = False) -> list[torch.Tensor]:
    """transformers' final states (a classifier's logits, a token classifier's
    ``[tokens, labels]`` with ``per_token``) on the file in ``path`` for each input
    alone: a text, a ``(text, text)`` pair (with its token types), or token ids (token
    type 0 throughout) — the reference the engine is checked against."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    cls = transformers.AutoModelForTokenClassification if per_token else \
        transformers.AutoModelForSequenceClassification if classifier \
        else transformers.AutoModel
    model = cls.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for x in inputs:
            if isinstance(x, list):
                enc = {"input_ids": torch.tensor([x])}
            elif isinstance(x, tuple):
                enc = tok(*x, return_tensors="pt")
            else:
                enc = tok(x, return_tensors="pt")
            res = model(**enc)
            out.append(res.logits[0] if classifier or per_token else res.last_hidden_state[0])
    return out


def write_random_multi_vector(dest: str | Path, kind: str, dim: int = 16, seed: int = 0,
                              dim_in_config: bool = False, **encoder: Any) -> str:
    """A random multi-vector encoder in ``dest`` laid out as the real files are
    (``multi_vector_config``): "colbert", colbert-ir's ``HF_ColBERT`` (the BERT under
    ``bert.``, ``linear.weight`` beside it; the width in ``config.json`` only with
    ``dim_in_config``), or "bge-m3", an XLM-R base model with ``colbert_linear.pt``
    and ``sparse_linear.pt`` beside it; ``encoder`` goes to ``write_random_encoder``
    (sizes, vocabulary). Returns the directory."""
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    family = "bert" if kind == "colbert" else "xlm-roberta"
    write_random_encoder(dest, family, seed=seed, **encoder)
    cfg = json.loads((dest / "config.json").read_text())
    hidden = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    if kind == "colbert":
        state = {f"bert.{k}": v for k, v in load_file(dest / "model.safetensors").items()}
        state["linear.weight"] = rand(dim, hidden)
        save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
        cfg["architectures"] = ["HF_ColBERT"]
        if dim_in_config:
            cfg["dim"] = dim
        (dest / "config.json").write_text(json.dumps(cfg))
    else:
        torch.save({"weight": rand(dim, hidden), "bias": rand(dim)}, dest / "colbert_linear.pt")
        torch.save({"weight": rand(1, hidden), "bias": rand(1) + 0.5}, dest / "sparse_linear.pt")
    return str(dest)


def hf_multi_vector_outputs(path: str | Path, kind: str, inputs: list[str]
                            ) -> list[dict[str, torch.Tensor]]:
    """What each task gives for each input, from transformers' final states and the
    heads' formulas as colbert-ir and FlagEmbedding's ``BGEM3FlagModel`` apply them:
    "token_embed" the unit-length projection of every token's state (BGE-M3's skip
    its first token), BGE-M3's "embed" its first token's unit state and
    "token_classify" ``relu(sparse_linear(h))`` of every token but the first and last."""
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    if kind == "colbert":
        heads = {"colbert": (load_file(path / "model.safetensors")["linear.weight"], None)}
    else:
        heads = {name: (s["weight"], s["bias"]) for name in ("colbert", "sparse")
                 for s in [torch.load(path / f"{name}_linear.pt", weights_only=True)]}
    norm = torch.nn.functional.normalize
    out = []
    with torch.no_grad():
        for text in inputs:
            h = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            colbert = torch.nn.functional.linear(h, *heads["colbert"])
            if kind == "colbert":
                out.append({"token_embed": norm(colbert, dim=-1)})
                continue
            sparse = torch.relu(torch.nn.functional.linear(h, *heads["sparse"]))
            out.append({"embed": norm(h[0], dim=-1), "token_embed": norm(colbert[1:], dim=-1),
                        "token_classify": sparse[1:-1, 0]})
    return out
