"""SPLADE sparse encoders: a BERT masked-LM file with sentence-transformers'
``SpladePooling`` embeds as ``log1p(relu(logits))`` pooled over the prompt (max or
sum), equal to transformers' masked-LM logits so pooled, scores as their dot
product, and refuses what does not apply to it by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, PoolingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing_encoders import hf_splade_vectors, write_random_encoder
from tests.cluster.test_encoders import DOCS, QUERY, TEXTS
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


@pytest.mark.parametrize(("strategy", "tied"), [("max", True), ("sum", False)])
def test_sparse_vectors_equal_transformers(tmp_path, strategy, tied) -> None:
    """Prompts of 5, 37 and 3 tokens in one step; the decoder is the tied word
    embedding (the file holds no decoder rows) or the file's own rows; no
    normalisation, as sentence-transformers gives them; ``LLM.score`` is their dot
    product."""
    path = write_random_encoder(tmp_path / "splade", "bert", splade=strategy, seed=3,
                                tie_word_embeddings=tied)
    want = hf_splade_vectors(path, TEXTS, strategy)
    pairs = hf_splade_vectors(path, [QUERY, *DOCS], strategy)
    llm = LLM(model=path, max_num_seqs=8)
    try:
        info = llm.engine.model_info
        assert info["pooling_type"] == "splade" and info["embedding_only"]
        for o, w in zip(llm.embed(TEXTS), want, strict=True):
            got = torch.tensor(o.outputs.embedding)
            assert got.shape == w.shape == (info["vocab_size"],)
            torch.testing.assert_close(got, w, rtol=1e-5, atol=2e-5)
        scores = [s.outputs.score for s in llm.score(QUERY, DOCS)]
        torch.testing.assert_close(torch.tensor(scores), torch.stack(
            [pairs[0] @ d for d in pairs[1:]]), rtol=1e-5, atol=1e-4)
        with pytest.raises(ValueError, match="dimensions does not apply"):
            llm.embed(TEXTS[:1], PoolingParams(dimensions=8))
        with pytest.raises(ValueError, match="pools 'splade'"):
            llm.embed(TEXTS[:1], PoolingParams(pooling_type="mean"))
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_what_splade_cannot_be_is_refused_by_name(tmp_path) -> None:
    path = Path(write_random_encoder(tmp_path / "splade", "bert", splade="max"))
    assert ModelConfig.from_pretrained(path).encoder.sparse == "max"
    pooling = path / "1_SpladePooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_strategy": "max",
                                   "activation_function": "log1p_relu"}))
    with pytest.raises(ValueError, match="activation_function"):
        ModelConfig.from_pretrained(path)
    pooling.write_text(json.dumps({"pooling_strategy": "mean"}))
    with pytest.raises(ValueError, match="pooling_strategy"):
        ModelConfig.from_pretrained(path)
    (path / "modules.json").unlink()  # a plain masked-LM file: nothing to serve
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_pretrained(path)
    roberta = Path(write_random_encoder(tmp_path / "rob", "roberta", splade="max"))
    with pytest.raises(ValueError, match="SPLADE sparse encoders are served for BERT"):
        ModelConfig.from_pretrained(roberta)
    with pytest.raises(ValueError, match="pools 'splade'"):  # (and only it does)
        llm = LLM(model=write_random_encoder(tmp_path / "plain", "bert"))
        try:
            llm.embed(TEXTS[:1], PoolingParams(pooling_type="splade"))
        finally:
            llm.shutdown()
