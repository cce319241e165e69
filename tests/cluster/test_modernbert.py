"""ModernBERT: embeddings and classifiers equal transformers on random files whose
local layers see 4 positions each side of a token, over prompts up to 37 tokens
long sharing one step; its config is read in both layouts (transformers 5's and the
released files'), and what it cannot serve is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, PoolingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing_encoders import hf_encoder_outputs, write_random_encoder
from tests.cluster.test_encoders import TEXTS
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("modernbert")
    return {
        "base": write_random_encoder(root / "base", "modernbert"),
        "embed": write_random_encoder(root / "embed", "modernbert", pooling="mean", seed=1),
        "cls-3": write_random_encoder(root / "cls3", "modernbert", num_labels=3, seed=2),
        "mean-1": write_random_encoder(root / "mean1", "modernbert", num_labels=1, seed=3,
                                       classifier_pooling="mean", norm_bias=True,
                                       classifier_bias=True),
    }


def _close(got: list[float], want: torch.Tensor, tol: float = 2e-5) -> None:
    assert len(got) == want.numel()
    err = (torch.tensor(got) - want).abs().max().item()
    assert err < tol, err


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_embeddings_equal_transformers(files, device) -> None:
    """First-token and mean pooling over prompts of 5, 37 and 3 tokens in one step (the
    long one padded beside the others, its local layers masked to a band); the
    sentence-transformers file pools the mean by default. The ``cuda`` case is a
    ``gpu`` test for ``bash bench/gpu_check.sh``."""
    enc = ModelConfig.from_pretrained(files["base"]).encoder
    assert enc is not None and enc.layer_windows == (0, 4, 4) and not enc.norm_bias
    states = hf_encoder_outputs(files["base"], TEXTS)
    assert max(s.shape[0] for s in states) > 4 * 2 + 1
    tol = 2e-5 if device == "cpu" else 1e-4
    llm = LLM(model=files["base"], max_num_seqs=8, device=device, dtype="float32")
    try:
        info = llm.engine.model_info
        assert info["encoder"] and info["embedding_only"] and info["pooling_type"] == "cls"
        for pooling in ("cls", "mean"):
            outs = llm.embed(TEXTS, PoolingParams(normalize=False, pooling_type=pooling))
            for o, s in zip(outs, states, strict=True):
                _close(o.outputs.embedding, s[0] if pooling == "cls" else s.mean(0), tol)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    if device != "cpu":
        return
    want = [torch.nn.functional.normalize(s.mean(0), dim=0)
            for s in hf_encoder_outputs(files["embed"], TEXTS)]
    llm = LLM(model=files["embed"], max_num_seqs=8)
    try:
        assert llm.engine.model_info["pooling_type"] == "mean"
        for o, w in zip(llm.embed(TEXTS), want, strict=True):
            _close(o.outputs.embedding, w)
    finally:
        llm.shutdown()


def test_classifiers_equal_transformers(files, tmp_path) -> None:
    """A three-label classifier reading ``[CLS]``, a token classifier labelling every
    token, and a one-label cross-encoder reading the mean (``classifier_pooling:
    mean``, with biases on its norms and head dense): the head is dense, GELU,
    LayerNorm, then the labels, in fp32. A mean classifier takes no other pooling;
    int8 projections stay close."""
    want = [torch.softmax(x, -1) for x in hf_encoder_outputs(files["cls-3"], TEXTS, True)]
    llm = LLM(model=files["cls-3"])
    try:
        assert llm.engine.model_info["pooling_type"] == "cls"
        for o, w in zip(llm.classify(TEXTS), want, strict=True):
            _close(o.outputs.probs, w)
    finally:
        llm.shutdown()
    tagger = write_random_encoder(tmp_path / "tagger", "modernbert", num_labels=4,
                                  per_token=True, seed=5)
    want = [torch.softmax(x, -1) for x in hf_encoder_outputs(tagger, TEXTS, per_token=True)]
    llm = LLM(model=tagger, max_num_seqs=8)
    try:  # a token classifier: the same head on every token
        for o, w in zip(llm.encode(TEXTS, pooling_task="token_classify"), want, strict=True):
            torch.testing.assert_close(o.outputs.data, w, rtol=0, atol=2e-5)
    finally:
        llm.shutdown()
    query, docs = TEXTS[0], TEXTS[1:]
    want = [torch.sigmoid(x) for x in
            hf_encoder_outputs(files["mean-1"], [(query, d) for d in docs], True)]
    for quantization, tol in ((None, 2e-5), ("int8", 3e-3)):
        llm = LLM(model=files["mean-1"], quantization=quantization)
        try:
            assert llm.engine.model_info["pooling_type"] == "mean"
            for s, w in zip(llm.score(query, docs), want, strict=True):
                assert abs(s.outputs.score - w.item()) < tol
            if quantization is None:
                with pytest.raises(ValueError, match="'mean' pooling"):
                    llm.classify(["w1"], pooling_params=PoolingParams(pooling_type="cls"))
            assert_pool_at_baseline(llm)
        finally:
            llm.shutdown()


def _released_layout(cfg: dict) -> dict:
    """``cfg`` as the released files write it (before transformers 5)."""
    out = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_parameters")}
    full, local = cfg["rope_parameters"]["full_attention"], \
        cfg["rope_parameters"]["sliding_attention"]
    return {**out, "global_attn_every_n_layers": 3, "global_rope_theta": full["rope_theta"],
            "local_rope_theta": local["rope_theta"]}


def test_both_config_layouts_read_alike_and_bad_fields_are_named(files) -> None:
    cfg = json.loads(Path(files["base"], "config.json").read_text())
    new = ModelConfig.from_hf_dict(cfg)
    old = ModelConfig.from_hf_dict(_released_layout(cfg))
    assert new == old and new.rope_theta == 160_000.0
    assert new.encoder is not None and new.encoder.local_rope_theta == 10_000.0
    null_local = ModelConfig.from_hf_dict({**_released_layout(cfg), "local_rope_theta": None})
    assert null_local.encoder is not None and null_local.encoder.local_rope_theta == 160_000.0
    bad = {
        "local_attention": ({"local_attention": 7}, "local_attention"),
        "layer_types": ({"layer_types": ["full_attention"]}, "layer_types"),
        "rope": ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                      "sliding_attention": {}}}, "rope_type"),
        "rope_scaling": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                         "rope_scaling"),
        "pooling": ({"classifier_pooling": "max"}, "classifier_pooling"),
        "activation": ({"hidden_activation": "relu"}, "hidden_activation"),
        "masked-lm": ({"architectures": ["ModernBertForMaskedLM"]}, "architectures"),
    }
    for change, field in bad.values():
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf_dict({**cfg, **change})
