"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): embeddings, classifiers and
cross-encoders equal transformers on the same random files, prompts of different
lengths sharing one step; the engine runs them whole (no chunking, no prefix
caching) and keeps no KV cache; options and requests an encoder cannot serve are
refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, PoolingParams, SamplingParams
from pagedserve.cluster.text_pairs import truncated_ids
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.pooling_config import sentence_transformers_pooling
from pagedserve.worker.testing_encoders import (
    hf_encoder_outputs,
    write_random_encoder,
    write_sentence_transformers_pooling,
)
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

TEXTS = ["w1 w2 w3", " ".join(f"w{i}" for i in range(5, 40)), "w40"]
QUERY, DOCS = "w1 w2 w9", ["w3 w4 w5 w6", "w9", "w2 w1 w9 w9 w7"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("enc")
    return {
        "bert": write_random_encoder(root / "bert", "bert"),
        "roberta": write_random_encoder(root / "roberta", "roberta", seed=1),
        "xlm-roberta": write_random_encoder(root / "xlmr", "xlm-roberta", seed=2),
        "bert-mean": write_random_encoder(root / "bert_mean", "bert", pooling="mean", seed=3),
        "cross": write_random_encoder(root / "cross", "bert", num_labels=1, seed=4),
        "roberta-3": write_random_encoder(root / "rob3", "roberta", num_labels=3, seed=5,
                                          id2label={0: "a", 1: "b", 2: "c"},
                                          label2id={"a": 0, "b": 1, "c": 2}),
    }


def _close(got: list[float], want: torch.Tensor, tol: float = 2e-5) -> None:
    assert len(got) == want.numel()
    err = (torch.tensor(got) - want).abs().max().item()
    assert err < tol, err


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_embeddings_equal_transformers(encoders, family) -> None:
    """First-token (the default) and mean pooling over prompts of 3-37 tokens in one
    step, then a step of one-token prompts; twice, since nothing is cached."""
    path = encoders[family]
    states = hf_encoder_outputs(path, TEXTS)
    ones = [[7], [9], [2]]
    one_states = hf_encoder_outputs(path, ones)
    llm = LLM(model=path, max_num_seqs=8)
    try:
        info = llm.engine.model_info
        assert info["encoder"] and info["embedding_only"] and info["pooling_type"] == "cls"
        sched = llm.engine.scheduler
        assert not sched.config.enable_chunked_prefill
        assert not sched.cache_config.enable_prefix_caching
        worker = llm.engine.executor.worker
        assert worker.kv_cache.key_caches == [] and info["bytes_per_block"] == 0
        for _ in range(2):
            raw = llm.embed(TEXTS, PoolingParams(normalize=False))
            for o, s in zip(raw, states, strict=True):
                _close(o.outputs.embedding, s[0])
        mean = llm.embed(TEXTS, PoolingParams(pooling_type="mean", normalize=False))
        for o, s in zip(mean, states, strict=True):
            _close(o.outputs.embedding, s.mean(0))
        unit = llm.embed(TEXTS[:1])[0].outputs.embedding
        _close(unit, torch.nn.functional.normalize(states[0][0], dim=0))
        for o, s in zip(llm.embed(ones, PoolingParams(normalize=False)), one_states,
                        strict=True):
            _close(o.outputs.embedding, s[0])
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_sentence_transformers_pooling_is_the_default(encoders, tmp_path) -> None:
    """``1_Pooling/config.json`` names mean pooling: requests that name none get it,
    normalised; a mode not served here fails at start, naming it."""
    path = encoders["bert-mean"]
    assert sentence_transformers_pooling(path) == "mean"
    states = hf_encoder_outputs(path, TEXTS)
    llm = LLM(model=path)
    try:
        assert llm.engine.model_info["pooling_type"] == "mean"
        for o, s in zip(llm.embed(TEXTS), states, strict=True):
            _close(o.outputs.embedding, torch.nn.functional.normalize(s.mean(0), dim=0))
    finally:
        llm.shutdown()
    write_sentence_transformers_pooling(tmp_path, "mean", 32)
    cfg = tmp_path / "1_Pooling" / "config.json"
    cfg.write_text(cfg.read_text().replace('"pooling_mode_mean_tokens": true',
                                           '"pooling_mode_max_tokens": true'))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        sentence_transformers_pooling(tmp_path)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_cross_encoder_scores_pairs_with_their_token_types(encoders, device) -> None:
    """A one-label BERT cross-encoder: each pair is ``[CLS] a [SEP] b [SEP]`` with the
    second text as token type 1 (the engine derives it from the first separator), its
    head (pooler, then classifier) reads ``[CLS]``; the score is the sigmoid of
    transformers' logit (on the CPU, in fp32). Its head takes no other pooling. The
    ``cuda`` case is a ``gpu`` test for ``bash bench/gpu_check.sh``."""
    path = encoders["cross"]
    want = [torch.sigmoid(x)
            for x in hf_encoder_outputs(path, [(QUERY, d) for d in DOCS], classifier=True)]
    llm = LLM(model=path, device=device, dtype="float32")
    try:
        assert llm.engine.model_info["pooling_type"] == "cls"
        scores = llm.score(QUERY, DOCS)
        for s, w in zip(scores, want, strict=True):
            assert abs(s.outputs.score - w.item()) < (2e-5 if device == "cpu" else 1e-4)
        assert len(set(round(s.outputs.score, 6) for s in scores)) == len(DOCS)
        with pytest.raises(ValueError, match="'cls' pooling"):
            llm.classify(["w1"], pooling_params=PoolingParams(pooling_type="mean"))
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    if device == "cpu":  # int8 projections (the head and embeddings stay float)
        llm = LLM(model=path, quantization="int8")
        try:
            for s, w in zip(llm.score(QUERY, DOCS), want, strict=True):
                assert abs(s.outputs.score - w.item()) < 3e-3
        finally:
            llm.shutdown()


def test_roberta_classifier_labels_equal_transformers(encoders) -> None:
    path = encoders["roberta-3"]
    want = [torch.softmax(x, -1) for x in hf_encoder_outputs(path, TEXTS, classifier=True)]
    llm = LLM(model=path)
    try:
        info = llm.engine.model_info["classifier"]
        assert info["labels"] == ["a", "b", "c"] and info["activation"] == "softmax"
        for o, w in zip(llm.classify(TEXTS), want, strict=True):
            _close(o.outputs.probs, w)
        with pytest.raises(ValueError, match="embed"):
            llm.embed(TEXTS[:1])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_token_classifiers_label_every_token(tmp_path, family) -> None:
    """A ``...ForTokenClassification`` file (NER-style): ``LLM.encode`` gives each
    token's softmax over transformers' logits, its default task; it serves nothing
    else, and the token embedder's own task gives each token's normalised state."""
    path = write_random_encoder(tmp_path / "tok", family, num_labels=5, per_token=True,
                                seed=6)
    want = [torch.softmax(x, -1) for x in hf_encoder_outputs(path, TEXTS, per_token=True)]
    llm = LLM(model=path, max_num_seqs=8)
    try:
        info = llm.engine.model_info
        assert info["pooling_type"] == "all" and info["classifier"]["per_token"]
        outs = llm.encode(TEXTS)
        for o, w in zip(outs, want, strict=True):
            assert o.outputs.data.shape == w.shape
            torch.testing.assert_close(o.outputs.data, w, rtol=0, atol=2e-5)
        raw = llm.encode(TEXTS[:1], PoolingParams(use_activation=False))[0].outputs.data
        torch.testing.assert_close(raw.softmax(-1), want[0], rtol=0, atol=2e-5)
        for call in (lambda: llm.classify(TEXTS[:1]), lambda: llm.embed(TEXTS[:1]),
                     lambda: llm.score(QUERY, DOCS[:1])):
            with pytest.raises(ValueError, match=r"token classifier|does not embed"):
                call()
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_truncation_keeps_the_first_token_and_the_separator(encoders) -> None:
    """``truncate_prompt_tokens`` on an encoder keeps ``[CLS]``, the text's start and the
    closing ``[SEP]`` (what a right-truncating BERT tokenizer keeps), and the result is
    transformers' state on exactly those ids."""
    path = encoders["bert"]
    llm = LLM(model=path)
    try:
        ids = llm.get_tokenizer().encode(TEXTS[1])
        out = llm.embed([TEXTS[1]], PoolingParams(normalize=False),
                        truncate_prompt_tokens=6)[0]
        assert out.prompt_token_ids == ids[:5] + ids[-1:] == truncated_ids(ids, 6, True)
        _close(out.outputs.embedding, hf_encoder_outputs(path, [out.prompt_token_ids])[0][0])
        assert truncated_ids(ids, 6) == ids[-6:]  # (a decoder keeps the end)
    finally:
        llm.shutdown()


def test_what_an_encoder_cannot_serve_is_refused_by_name(encoders, tmp_path) -> None:
    path = encoders["bert"]
    with pytest.raises(ValueError, match="enable_lora is not supported for encoder"):
        LLM(model=path, enable_lora=True)
    llm = LLM(model=path)
    try:
        with pytest.raises(ValueError, match="embedding model"):
            llm.generate(["w1 w2"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError):  # 80 positions: 81 tokens do not fit
            llm.embed([[7] * 81])
        assert len(llm.embed([[7] * 80])[0].outputs.embedding) == 32
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    enc = ModelConfig.from_pretrained(path).encoder
    assert enc is not None and enc.type_vocab_size == 2 and enc.sep_token_id == 3
    masked = write_random_encoder(tmp_path / "mlm", "bert")
    text = (tmp_path / "mlm" / "config.json").read_text()
    (tmp_path / "mlm" / "config.json").write_text(text.replace('"BertModel"',
                                                               '"BertForMaskedLM"'))
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_pretrained(masked)


def test_matryoshka_widths_follow_the_file(encoders) -> None:
    """vLLM's fields, through ``hf_overrides``: ``matryoshka_dimensions`` allows only its
    widths (the cut is the full vector's head, renormalised), ``is_matryoshka: false``
    no cut; a file that says nothing takes any width. Bad fields are refused by name."""
    path = encoders["bert"]
    full = torch.nn.functional.normalize(hf_encoder_outputs(path, TEXTS[:1])[0][0], dim=-1)
    llm = LLM(model=path, hf_overrides={"matryoshka_dimensions": [8, 16]})
    try:
        assert llm.engine.model_info["matryoshka"] == [8, 16]
        cut = llm.embed(TEXTS[:1], PoolingParams(dimensions=8))[0].outputs.embedding
        _close(cut, torch.nn.functional.normalize(full[:8], dim=-1))
        with pytest.raises(ValueError, match=r"one of the widths .*: \[8, 16\]"):
            llm.embed(TEXTS[:1], PoolingParams(dimensions=12))
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    for overrides, says in [({"is_matryoshka": False}, "not a Matryoshka embedder"),
                            ({"is_matryoshka": "yes"}, "'is_matryoshka' must be true"),
                            ({"matryoshka_dimensions": [8, 0]}, "positive integer"),
                            ({"matryoshka_dimensions": 8}, "non-empty list")]:
        with pytest.raises(ValueError, match=says):
            llm = LLM(model=path, hf_overrides=overrides)
            try:
                llm.embed(TEXTS[:1], PoolingParams(dimensions=12))
            finally:
                llm.shutdown()
