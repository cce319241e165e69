"""Sequence classifiers (``...ForSequenceClassification`` files): ``LLM.classify`` gives
Hugging Face's label probabilities, ``LLM.score`` scores a pair as a cross-encoder
does, and a classifier refuses to generate or embed (a generative model refuses to
classify). The head is the file's ``score`` rows over the last token's final state."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, PoolingParams, SamplingParams
from pagedserve.cluster.text_pairs import pair_token_ids
from pagedserve.worker.classifier import classifier_config
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

LONG = [(7 * i + 3) % 300 + 4 for i in range(70)]
PROMPTS = [[5, 9, 33, 7, 100, 4], [8, 3], LONG, [*LONG[:40], 11, 12, 13]]
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


def _hf_logits(path: str, prompts: list[list[int]], mean: bool = False,
               every: bool = False) -> list[torch.Tensor]:
    """HF's label logits per prompt (one at a time: no padding); ``mean``: its score
    head over the mean final state instead of the last token's; ``every``: over each
    token's (``[tokens, labels]``)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            if mean or every:
                hidden = model.model(ids).last_hidden_state[0]
                out.append(model.score(hidden.mean(0) if mean else hidden))
            else:
                out.append(model(ids).logits[0])
    return out


def _close(got: list[float], want: torch.Tensor, tol: float = 2e-5) -> None:
    assert len(got) == want.numel()
    assert max(abs(a - b) for a, b in zip(got, want.tolist(), strict=True)) < tol, (got, want)


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("cls") / "llama3", "llama",
                                   classifier=True, id2label=LABELS, vocab_size=512,
                                   label2id={v: int(k) for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    from pagedserve.worker.loaders import resolve_model

    return write_random_checkpoint(tmp_path_factory.mktemp("cls") / "qwen2ce", "qwen2",
                                   resolve_model(None).path, classifier=True, num_labels=1,
                                   weight_scale=2.0)


def test_classify_equals_hugging_face_whole_chunked_and_cached(three_labels) -> None:
    """Softmax over HF's logits, whether the prompt runs whole, in 16-token chunks, or
    from prefix-cache hits (the last position is always computed again); the labels
    come from ``id2label``; the mean state through the head equals HF's head on it."""
    want = [torch.softmax(x, -1) for x in _hf_logits(three_labels, PROMPTS)]
    want_mean = [torch.softmax(x, -1) for x in _hf_logits(three_labels, PROMPTS, mean=True)]
    llm = LLM(model=three_labels, num_gpu_blocks=64, block_size=16, max_num_batched_tokens=16)
    try:
        info = llm.engine.model_info["classifier"]
        assert info["labels"] == ["negative", "neutral", "positive"]
        assert info["activation"] == "softmax"
        for _ in range(2):  # the second pass starts from cached blocks
            outs = llm.classify(PROMPTS)
            for o, w in zip(outs, want, strict=True):
                _close(o.outputs.probs, w)
                assert o.outputs.num_classes == 3
        assert outs[2].prompt_token_ids == LONG
        assert llm.engine.scheduler.kv.prefix_hits > 0
        raw = llm.classify(PROMPTS[:2], use_activation=False)
        for o, w in zip(raw, _hf_logits(three_labels, PROMPTS[:2]), strict=True):
            _close(o.outputs.probs, w)
        mean = llm.classify(PROMPTS, pooling_params=PoolingParams("mean"))
        for o, w in zip(mean, want_mean, strict=True):
            _close(o.outputs.probs, w)
        # vLLM's token_classify: the head on every prefix, its rows from every chunk.
        every = llm.encode(PROMPTS, pooling_task="token_classify")
        for o, w in zip(every, _hf_logits(three_labels, PROMPTS, every=True), strict=True):
            assert o.outputs.data.shape == w.shape
            torch.testing.assert_close(o.outputs.data, torch.softmax(w, -1), rtol=0, atol=2e-5)
        with pytest.raises(ValueError, match="does not embed"):
            llm.encode(PROMPTS[:1], pooling_task="token_embed")
        # Classification shares batches with nothing else it could corrupt: the pool is
        # back where it started.
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_refusals_name_what_the_model_serves(three_labels, tiny_llama_dir) -> None:
    llm = LLM(model=three_labels, num_gpu_blocks=32)
    try:
        with pytest.raises(ValueError, match="sequence classifier"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="does not embed"):
            llm.embed([[1, 2, 3]])
        with pytest.raises(ValueError, match="one-label classifier"):
            llm.score("a", "b")
        with pytest.raises(ValueError, match="dimensions is for embeddings"):
            PoolingParams(dimensions=4, task="classify")
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    gen = LLM(model=tiny_llama_dir, num_gpu_blocks=32)
    try:
        with pytest.raises(ValueError, match="needs a sequence classifier"):
            gen.classify([[1, 2, 3]])
    finally:
        gen.shutdown()


def test_cross_encoder_scores_each_pair_as_one_prompt(cross_encoder) -> None:
    """A one-label classifier scores ``(query, document)`` as the tokenizer's pair
    encoding through a sigmoid, as sentence-transformers' ``CrossEncoder`` does with a
    Hugging Face model; ``classify`` gives the same one probability."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cross_encoder)
    query, docs = "What is paged attention?", ["Blocks of KV cache.", "A recipe for bread."]
    pairs = [tok(query, text_pair=d)["input_ids"] for d in docs]
    want = [torch.sigmoid(x) for x in _hf_logits(cross_encoder, pairs)]
    llm = LLM(model=cross_encoder, num_gpu_blocks=32)
    try:
        scores = llm.score(query, docs)
        for s, w in zip(scores, want, strict=True):
            _close([s.outputs.score], w)
        assert [s.prompt_token_ids for s in scores] == pairs
        assert scores[0].outputs.score != scores[1].outputs.score
        probs = llm.classify([{"prompt_token_ids": p} for p in pairs])
        for o, w in zip(probs, want, strict=True):
            _close(o.outputs.probs, w)
        pairwise = llm.score([query, docs[1]], docs)  # two lists: pair by pair
        assert pairwise[0].outputs.score == pytest.approx(scores[0].outputs.score, abs=1e-6)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("extra", "activation", "score_activation"), [
    ({}, "softmax", "softmax"),
    ({"problem_type": "multi_label_classification"}, "sigmoid", "softmax"),
    ({"problem_type": "regression", "num_labels": 1}, "identity", "sigmoid"),
    ({"num_labels": 1, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}, "sigmoid", "identity"),
    ({"num_labels": 1, "sbert_ce_default_activation_function":
        "torch.nn.modules.activation.Tanh"}, "sigmoid", "tanh"),
])
def test_activations_follow_the_config(extra, activation, score_activation) -> None:
    """vLLM's choice, after transformers' loss: softmax over several labels, sigmoid for
    one or for multi-label problems, none for regression; a cross-encoder's stored
    sentence-transformers activation for scores."""
    cfg = classifier_config({"architectures": ["LlamaForSequenceClassification"], **extra})
    assert cfg is not None
    assert (cfg.activation, cfg.score_activation) == (activation, score_activation)
    assert cfg.num_labels == extra.get("num_labels", 2)


@pytest.mark.parametrize(("extra", "field"), [
    ({"id2label": {"0": "a", "2": "b"}}, "id2label"),
    ({"id2label": {"x": "a"}}, "id2label"),
    ({"num_labels": 0}, "num_labels"),
    ({"problem_type": "ranking"}, "problem_type"),
    ({"sentence_transformers": {"activation_fn": "os.system"}}, "activation"),
    ({"use_sep_token": "yes"}, "use_sep_token"),
])
def test_bad_classifier_configs_name_the_field(extra, field) -> None:
    with pytest.raises(ValueError, match=field):
        classifier_config({"architectures": ["Qwen2ForSequenceClassification"], **extra})


RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


@pytest.mark.parametrize("tied", [False, True])
def test_a_causal_lm_served_as_a_reranker_through_hf_overrides(tmp_path, tied) -> None:
    """vLLM's recipe for Qwen3-Reranker: the causal file, ``hf_overrides`` naming a
    classifier made of the "no" and "yes" rows. Its score is HF's causal LM's
    softmax of "yes" against "no" at the last token of the joined texts (the model
    card's ``compute_logits``); three tokens without post-processing classify over
    their own logits. The head reads those rows, from the LM head or the tied
    embedding; ``use_sep_token`` turns the tokenizer's pair encoding back on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.worker.loaders import resolve_model

    path = write_random_checkpoint(tmp_path / "qwen3", "qwen3", resolve_model(None).path,
                                   tie_word_embeddings=tied)
    tok = AutoTokenizer.from_pretrained(path)
    no, yes, maybe = tok.convert_tokens_to_ids(["no", "yes", "maybe"])
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    query = "<Query>: what is paged attention?\n<Document>: "
    docs = ["KV cache in blocks.", "Bread and butter."]
    # An LLM made a reranker joins the texts and tokenises them as one (vLLM's
    # use_sep_token false): " KV" is one token here, not " " and "KV".
    pairs = [tok(query + d)["input_ids"] for d in docs]
    with torch.no_grad():
        last = [hf(torch.tensor([p])).logits[0, -1] for p in pairs]
    llm = LLM(model=path, num_gpu_blocks=32, hf_overrides=RERANKER)
    try:
        assert llm.engine.model_info["classifier"]["labels"] == ["yes"]
        scores = llm.score(query, docs)
        assert [s.prompt_token_ids for s in scores] == pairs
        for s, x in zip(scores, last, strict=True):
            _close([s.outputs.score], torch.softmax(x[[no, yes]], -1)[1:])
        with pytest.raises(ValueError, match="sequence classifier"):
            llm.generate([[1, 2]])
    finally:
        llm.shutdown()
    three = {"architectures": ["Qwen3ForSequenceClassification"],
             "classifier_from_token": ["no", "maybe", "yes"], "use_sep_token": True}
    llm = LLM(model=path, num_gpu_blocks=32, hf_overrides=three)
    try:
        for o, x in zip(llm.classify(pairs), last, strict=True):
            _close(o.outputs.probs, torch.softmax(x[[no, maybe, yes]], -1))
        assert llm.engine.model_info["classifier"]["pair_encoding"] is True
    finally:
        llm.shutdown()
    assert pair_token_ids(tok, query, docs[0]) == tok(query, text_pair=docs[0])["input_ids"]
    assert pair_token_ids(tok, query, docs[0], pair_encoding=False) == pairs[0]
    assert pair_token_ids(tok, query, docs[0]) != pairs[0]


@pytest.mark.parametrize(("overrides", "says"), [
    ({"classifier_from_token": ["no", "yes"]}, "architectures naming"),
    ({**RERANKER, "classifier_from_token": ["no", "yes", "maybe"]}, "two tokens"),
    ({**RERANKER, "classifier_from_token": ["no", "zzqx-not-a-token"]}, "not a token"),
    ({**RERANKER, "is_original_qwen3_reranker": False, "method": "pooled"}, "method"),
])
def test_bad_overrides_fail_before_any_rank_starts(default_model_dir, overrides,
                                                   says) -> None:
    with pytest.raises(ValueError, match=says):
        LLM(model=default_model_dir, num_gpu_blocks=32, hf_overrides=overrides)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


@pytest.mark.parametrize(("kind", "extra", "activation"), [
    ("qwen3", {"num_labels": 4, "problem_type": "multi_label_classification"}, torch.sigmoid),
    ("phi3", {"num_labels": 3, "pad_token_id": 0}, _softmax),
    ("gemma3_text", {"num_labels": 3}, _softmax),
    ("qwen2_moe", {"num_labels": 3}, _softmax),
])
def test_other_families_classify_as_hugging_face(tmp_path, kind, extra, activation) -> None:
    """The head is the same for every decoder: a multi-label Qwen3 file gives independent
    sigmoids; Phi-3's fused projections, Gemma 3's norms and scaled embedding, and a
    mixture of experts give transformers' probabilities (Gemma 2, Mistral, Mixtral and
    Qwen3-MoE did too, by hand)."""
    path = write_random_checkpoint(tmp_path / kind, kind, classifier=True, vocab_size=512,
                                   **extra)
    want = [activation(x) for x in _hf_logits(path, PROMPTS[:2])]
    llm = LLM(model=path, num_gpu_blocks=32)
    try:
        for o, w in zip(llm.classify(PROMPTS[:2]), want, strict=True):
            _close(o.outputs.probs, w)
    finally:
        llm.shutdown()
