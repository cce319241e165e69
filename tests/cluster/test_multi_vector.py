"""Multi-vector encoders: a ColBERT file's token vectors and BGE-M3's three outputs
(dense, ColBERT, lexical weights) equal transformers' final states through the
heads' formulas, prompts of several lengths in one step; ColBERT scores by late
interaction (MaxSim), BGE-M3 by its dense vector; what they cannot serve, and a
file that is not what it says, are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, PoolingParams
from pagedserve.cluster.late_interaction import pair_score
from pagedserve.cluster.pooling import probe_pooling
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing_encoders import (
    hf_multi_vector_outputs,
    write_random_encoder,
    write_random_multi_vector,
)
from tests.cluster.test_encoders import DOCS, QUERY, TEXTS
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


def _maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    """MaxSim written out: each query token's best dot product, summed."""
    return sum(max(float(qi @ dj) for dj in d) for qi in q)


def test_colbert_token_vectors_and_maxsim_equal_transformers(tmp_path) -> None:
    """colbert-ir's layout (``bert.`` names, ``linear.weight``, the width only in the
    checkpoint); every token kept, [CLS] and [SEP] included, as vLLM does."""
    path = write_random_multi_vector(tmp_path / "colbert", "colbert", dim=12, seed=2)
    want = hf_multi_vector_outputs(path, "colbert", [*TEXTS, QUERY, *DOCS])
    llm = LLM(model=path, max_num_seqs=8)
    try:
        info = llm.engine.model_info
        assert info["multi_vector"]["dim"] == 12 and info["multi_vector"]["late_interaction"]
        assert probe_pooling(info).task == "token_embed"
        outs = llm.encode(TEXTS)  # (the model's own task: token_embed)
        for o, w in zip(outs, want[:len(TEXTS)], strict=True):
            assert o.outputs.data.shape == w["token_embed"].shape
            assert o.outputs.data.shape[0] == len(o.prompt_token_ids)
            torch.testing.assert_close(o.outputs.data, w["token_embed"], rtol=1e-5, atol=1e-5)
        scores = [s.outputs.score for s in llm.score(QUERY, DOCS)]
        q = want[len(TEXTS)]["token_embed"]
        expected = [_maxsim(q, w["token_embed"]) for w in want[len(TEXTS) + 1:]]
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected),
                                   rtol=1e-5, atol=1e-4)
        cut = llm.encode(TEXTS[:1], PoolingParams(dimensions=8))[0].outputs.data
        torch.testing.assert_close(cut, torch.nn.functional.normalize(
            want[0]["token_embed"][:, :8], dim=-1), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"exceeds the width of .* token vectors \(12\)"):
            llm.encode(TEXTS[:1], PoolingParams(dimensions=13))
        for task in ("embed", "token_classify"):
            with pytest.raises(ValueError, match=f"serves tasks \\['token_embed'\\].*{task}"):
                llm.encode(TEXTS[:1], pooling_task=task)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bge_m3_dense_colbert_and_lexical_outputs_equal_flagembeddings(tmp_path) -> None:
    """Found by its side files; the dense vector is the first token's; the ColBERT
    vectors skip ``<s>``, the lexical weights ``<s>`` and ``</s>`` (only when the prompt
    has them: token ids without them keep every row); ``score`` is the dense cosine."""
    path = write_random_multi_vector(tmp_path / "m3", "bge-m3", dim=24, seed=5)
    want = hf_multi_vector_outputs(path, "bge-m3", [*TEXTS, QUERY, *DOCS])
    llm = LLM(model=path, max_num_seqs=8)
    try:
        info = llm.engine.model_info
        assert info["multi_vector"]["kind"] == "bge-m3" and info["pooling_type"] == "cls"
        assert probe_pooling(info).task == "embed"
        for o, w in zip(llm.embed(TEXTS), want[:len(TEXTS)], strict=True):
            torch.testing.assert_close(torch.tensor(o.outputs.embedding), w["embed"],
                                       rtol=1e-5, atol=1e-5)
        for task in ("token_embed", "token_classify"):
            for o, w in zip(llm.encode(TEXTS, pooling_task=task), want[:len(TEXTS)],
                            strict=True):
                assert o.outputs.data.shape == w[task].shape, task
                torch.testing.assert_close(o.outputs.data, w[task], rtol=1e-5, atol=1e-5)
        bare = [7, 9, 11]  # (no <s>, no </s>: nothing is left out)
        assert llm.encode([bare], pooling_task="token_classify")[0].outputs.data.shape == (3,)
        assert llm.encode([bare], pooling_task="token_embed")[0].outputs.data.shape == (3, 24)
        scores = [s.outputs.score for s in llm.score(QUERY, DOCS)]
        q = want[len(TEXTS)]["embed"]
        torch.testing.assert_close(torch.tensor(scores), torch.stack(
            [q @ w["embed"] for w in want[len(TEXTS) + 1:]]), rtol=1e-5, atol=1e-5)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_what_a_multi_vector_file_cannot_be_is_refused_by_name(tmp_path) -> None:
    colbert = Path(write_random_multi_vector(tmp_path / "c", "colbert", dim=8,
                                             dim_in_config=True))
    assert ModelConfig.from_pretrained(colbert).encoder.multi_vector.dim == 8
    cfg = json.loads((colbert / "config.json").read_text())
    with pytest.raises(ValueError, match="projection's width"):  # (no dim, no checkpoint)
        ModelConfig.from_hf_dict({k: v for k, v in cfg.items() if k != "dim"}, None)
    with pytest.raises(ValueError, match="ColBERT files are served for BERT"):
        ModelConfig.from_hf_dict({**cfg, "model_type": "roberta"}, None)
    with pytest.raises(ValueError, match="architectures"):  # (one class, not a mixture)
        ModelConfig.from_hf_dict({**cfg, "architectures": [
            "HF_ColBERT", "BertForSequenceClassification"]}, str(colbert))
    m3 = Path(write_random_multi_vector(tmp_path / "m3", "bge-m3", dim=8))
    with pytest.raises(ValueError, match="not also a classifier"):
        ModelConfig.from_pretrained(m3, {"architectures": [
            "XLMRobertaForSequenceClassification"]})
    torch.save({"weight": torch.zeros(2, 32)}, m3 / "sparse_linear.pt")
    with pytest.raises(ValueError, match=r"sparse_linear\.pt: its weight must have one row"):
        ModelConfig.from_pretrained(m3)
    torch.save({"weight": torch.zeros(1, 31)}, m3 / "sparse_linear.pt")
    with pytest.raises(ValueError, match=r"shape \[rows, 32\], got \(1, 31\)"):
        ModelConfig.from_pretrained(m3)
    (m3 / "sparse_linear.pt").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=r"sparse_linear\.pt: not a torch state dict"):
        ModelConfig.from_pretrained(m3)
    (m3 / "sparse_linear.pt").unlink()  # one side file alone: a plain XLM-R embedder
    assert ModelConfig.from_pretrained(m3).encoder.multi_vector is None
    with pytest.raises(ValueError, match=r"needs colbert_linear\.pt and sparse_linear\.pt"):
        ModelConfig.from_pretrained(m3, {"architectures": ["BgeM3EmbeddingModel"]})
    bert = write_random_encoder(tmp_path / "b", "bert")
    with pytest.raises(ValueError, match="BGE-M3 is an XLM-RoBERTa encoder"):
        ModelConfig.from_pretrained(bert, {"architectures": ["BgeM3EmbeddingModel"]})


def test_pair_score_is_a_dot_product_or_maxsim() -> None:
    assert pair_score([0.6, 0.8], [1.0, 0.0]) == pytest.approx(0.6)
    q, d = torch.randn(3, 4), torch.randn(5, 4)
    assert pair_score(q, d) == pytest.approx(_maxsim(q, d), rel=1e-6)
    assert pair_score(q, d[:0]) == 0.0
    with pytest.raises(ValueError, match="MaxSim needs two"):
        pair_score(q, torch.randn(5, 3))


def test_the_health_probe_asks_each_pooling_model_for_a_task_it_serves() -> None:
    """A token classifier's probe labels tokens (asking it to classify was refused), a
    ColBERT's embeds tokens, a generator's generates."""
    from pagedserve.cluster.pooling import pool_for
    from pagedserve.scheduler.sampling_params import SamplingParams
    from pagedserve.worker.multi_vector_config import MultiVectorConfig

    labels = {"num_labels": 2, "labels": ["a", "b"], "activation": "softmax"}
    infos = {"token_classify": {"classifier": {**labels, "per_token": True}, "encoder": True},
             "classify": {"classifier": labels},
             "token_embed": {"multi_vector": MultiVectorConfig("colbert", 8).info()},
             "embed": {"embedding_only": True}}
    for task, info in infos.items():
        info = {"hidden_size": 32, **info}
        probe = probe_pooling(info)
        assert probe.task == task
        assert pool_for(probe, SamplingParams(max_tokens=1), info) is not None
    assert probe_pooling({"hidden_size": 32}) is None
