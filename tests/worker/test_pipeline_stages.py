"""Pipeline stages in one process: each stage builds and loads only its layers, and
chaining the stages' forwards gives the whole model's logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pagedserve.worker.pipeline import IntermediateTensors, PipelineStage, layer_partition
from pagedserve.worker.testing import GRANITE_SCALES
from pagedserve.worker.worker import Worker
from tests.worker.helpers import (
    BlockAllocator,
    load_hf,
    make_worker,
    plan,
    request,
    save_tiny_model,
)

PROMPTS = {"a": [5, 9, 17, 33, 4, 12, 7], "b": [8, 70, 12, 44, 90, 3, 61, 22, 19, 30, 2]}


def test_layer_partition_is_even_and_gives_the_rest_before_the_last_stage() -> None:
    assert layer_partition(3, 2) == [(0, 2), (2, 3)]
    assert layer_partition(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert layer_partition(30, 1) == [(0, 30)]
    assert layer_partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    stage = PipelineStage.of(10, 4, 3)
    assert (stage.start, stage.end, stage.is_first, stage.is_last) == (8, 10, False, True)
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        layer_partition(2, 3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive"):
        layer_partition(2, 0)
    with pytest.raises(ValueError, match="pipeline stage must be in"):
        PipelineStage.of(4, 2, 2)


def test_an_explicit_partition_is_taken_and_checked() -> None:
    assert layer_partition(30, 2, [19, 11]) == [(0, 19), (19, 30)]
    assert PipelineStage.of(5, 3, 1, (1, 3, 1)).num_layers == 3
    with pytest.raises(ValueError, match=r"holds 29 layers; the model has 30"):
        layer_partition(30, 2, [19, 10])
    with pytest.raises(ValueError, match="must be 2 positive layer counts"):
        layer_partition(30, 2, [30, 0])
    with pytest.raises(ValueError, match="must be 2 positive layer counts"):
        layer_partition(30, 2, [10, 10, 10])


def _stages(path, pp: int, **kw) -> list[Worker]:
    return [make_worker(path, num_blocks=40, pipeline_parallel_size=pp, pp_rank=r, **kw)
            for r in range(pp)]


def _chain(stages: list[Worker], p) -> object:
    """Run a plan through every stage as the executor does (hidden states on the host)."""
    carried = None
    for w in stages:
        out = w.execute_model(p, carried)
        if isinstance(out, IntermediateTensors):
            assert out.hidden.device.type == "cpu"
        carried = out
    return carried


def _greedy(run, n: int, groups: int = 1) -> dict[str, list[int]]:
    alloc = BlockAllocator(40, 4, seed=3, groups=groups)
    toks: dict[str, list[int]] = {r: [] for r in PROMPTS}
    reqs = [request(alloc, r, p, 0) for r, p in PROMPTS.items()]
    for step in range(n):
        out = run(plan(step, reqs))
        reqs = []
        for r, p in PROMPTS.items():
            toks[r].append(out.sampled[r].token_id)
            reqs.append(request(alloc, r, [toks[r][-1]], len(p) + len(toks[r]) - 1))
    return toks


@pytest.mark.parametrize("kind,tied", [("llama", False), ("qwen2", True),
                                       ("gemma3_text", True), ("deepseek_v3", False),
                                       ("granitemoeshared", True)])
def test_three_stages_equal_the_whole_model(tmp_path, kind: str, tied: bool) -> None:
    """A 5-layer model in stages of 2, 2 and 1 layers (the tied head of the last stage
    loads the embedding's rows itself) gives the whole model's greedy tokens, which
    are Hugging Face's (Gemma 3: each stage picks its own layers' RoPE tables; Granite:
    the first stage scales the embeddings, the last the logits)."""
    extra = {} if kind != "gemma3_text" else dict(
        head_dim=16, sliding_window=4, layer_types=["sliding_attention"] * 2
        + ["full_attention", "sliding_attention", "full_attention"])
    if kind == "deepseek_v3":  # (latent attention: one cache a layer, no value cache)
        extra = dict(num_key_value_heads=4)
    if kind == "granitemoeshared":  # (embeddings scaled on the first stage, logits last)
        extra = dict(GRANITE_SCALES)
    path = save_tiny_model(tmp_path / kind, kind, num_hidden_layers=5,
                           tie_word_embeddings=tied, **extra)
    whole = make_worker(path, num_blocks=40)
    stages = _stages(path, 3)
    assert [len(w.model.layers) for w in stages] == [2, 2, 1]
    assert stages[0].model.embed_tokens is not None and stages[0].model.lm_head is None
    assert stages[1].model.embed_tokens is None and stages[1].model.norm is None
    assert stages[2].model.embed_tokens is None and stages[2].model.lm_head is not None
    # Each stage's KV pool holds its own layers only. Gemma's KV cache groups (full
    # layers 2 and 4, sliding 0 and 1, sliding 3) share caches within a stage: layers 2
    # and 3 one, as the whole model's layers 0, 2 and 3 do.
    groups = whole.kv_layout.num_groups
    if kind == "gemma3_text":
        assert whole.kv_layout.layers == ((2, 4), (0, 1), (3,))
        assert [len(w.kv_cache.key_caches) for w in stages] == [2, 1, 1]
        assert len(whole.kv_cache.key_caches) == 2
    else:
        assert [len(w.kv_cache.key_caches) for w in stages] == [2, 2, 1]
        assert sum(w.block_bytes() for w in stages) == whole.block_bytes()
    # No stage holds another's weights: the middle one has neither embedding nor head.
    assert stages[1].weight_bytes < whole.weight_bytes / 2

    ref = _greedy(whole.execute_model, 6, groups)
    assert _greedy(lambda p: _chain(stages, p), 6, groups) == ref
    # Stages of 3, 1 and 1 layers (``pipeline_layer_partition``): the same tokens.
    uneven = _stages(path, 3, pipeline_layer_partition=(3, 1, 1))
    assert [len(w.model.layers) for w in uneven] == [3, 1, 1]
    assert [w.get_model_info()["pipeline_layer_partition"] for w in uneven] == [[3, 1, 1]] * 3
    assert _greedy(lambda p: _chain(uneven, p), 6, groups) == ref
    hf = load_hf(path)
    for r, p in PROMPTS.items():
        out = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):]
        assert out.tolist() == ref[r][:len(out)]  # (HF stops at EOS; this loop does not)


@pytest.mark.parametrize("kind", ["granitemoehybrid", "qwen3_next", "lfm2", "nemotron_h",
                                  "falcon_h1", "jamba", "mamba2"])
def test_hybrid_stages_equal_the_whole_model(tmp_path, kind: str) -> None:
    """Each stage keeps the recurrent states of its own mixers (numbered from 0 on it)
    and pages its own attention layers' KV: two stages give the whole model's greedy
    tokens."""
    path = save_tiny_model(tmp_path / kind, kind)
    whole = make_worker(path, num_blocks=40)
    groups = whole.kv_layout.num_groups
    stages = _stages(path, 2)
    held = [len(w.model.mamba_mixers()) for w in stages]
    assert sum(held) == len(whole.model.mamba_mixers()) and min(held) > 0
    assert [len(w.runner.states.conv) for w in stages] == held
    ref = _greedy(whole.execute_model, 6, groups)
    assert _greedy(lambda p: _chain(stages, p), 6, groups) == ref


def test_a_later_stage_without_hidden_states_fails_clearly(tmp_path) -> None:
    path = save_tiny_model(tmp_path / "m", num_hidden_layers=2)
    (_, last) = _stages(path, 2)
    alloc = BlockAllocator(40, 4)
    with pytest.raises(ValueError, match="needs the previous stage's hidden states"):
        last.execute_model(plan(0, [request(alloc, "a", PROMPTS["a"], 0)]))


def test_stage_settings_are_checked() -> None:
    from pagedserve.worker.worker_config import WorkerConfig

    with pytest.raises(ValueError, match="pp_rank must be in"):
        WorkerConfig(pipeline_parallel_size=2, pp_rank=2)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        WorkerConfig(pipeline_parallel_size=2, max_lora_rank=8)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive"):
        WorkerConfig(pipeline_parallel_size=0)


def test_a_headless_models_later_stage_holds_no_lm_head(tmp_path) -> None:
    """An embedder (a causal file served as ``LlamaModel``) in two stages: the last one
    holds no vocab x hidden head, which it would never run; its profile step pools
    instead of sampling; the stages pool the whole model's last states."""
    path = save_tiny_model(tmp_path / "emb", "llama", num_hidden_layers=4)
    over = {"architectures": ["LlamaModel"]}
    whole = make_worker(path, num_blocks=40, hf_overrides=over)
    stages = _stages(path, 2, hf_overrides=over)
    vocab = whole.model_config.vocab_size
    assert whole.model.lm_head is not None  # (tied to its embedding: no memory)
    assert stages[1].model.lm_head is None and stages[0].model.lm_head is None
    assert all(vocab not in p.shape for p in stages[1].model.parameters())
    stages[1].profile_forward()
    stages[1].init_kv_cache(40, 0)

    def pooled(run) -> dict[str, torch.Tensor]:
        alloc = BlockAllocator(40, 4, seed=3)
        reqs = [request(alloc, r, p, 0, sample=False) for r, p in PROMPTS.items()]
        for r in reqs:
            r.pooling, r.pool_final = "last", True
        return {r: v[1] for r, v in run(plan(0, reqs)).pooled.items()}

    want = pooled(whole.execute_model)
    got = pooled(lambda p: _chain(stages, p))
    for r in PROMPTS:
        torch.testing.assert_close(got[r], want[r], rtol=1e-5, atol=1e-5)
