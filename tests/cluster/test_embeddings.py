"""Embedding (pooling) requests through the real engine, against Hugging Face.

``LLM.embed`` pools the final hidden states (after the model's last norm),
which is what ``AutoModel(...).last_hidden_state`` gives; last-token and mean
pooling must equal it at fp32 tolerance whether the prompt runs in one step or
in chunks, from prefix-cache hits, after recompute preemption, or in the same
batches as generation, and the pool must return to baseline.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, PoolingParams, SamplingParams
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

TOL = 2e-5


def hf_hidden(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """``last_hidden_state`` of each prompt, one at a time (no padding)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def _vectors(outs: list) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def llama_hidden(tiny_llama_dir) -> list[torch.Tensor]:
    return hf_hidden(tiny_llama_dir, prompts_of_mixed_lengths())


@pytest.mark.parametrize("chunk", [2048, 16])
def test_last_and_mean_pooling_equal_hugging_face(tiny_llama_dir, llama_hidden, chunk) -> None:
    """Whole prompts and 16-token chunks (mean pooling sums the chunks' parts)."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=128, max_num_batched_tokens=chunk,
              max_num_seqs=4)
    try:
        prompts = prompts_of_mixed_lengths()
        last = llm.embed(prompts)
        _close(_vectors(last), [torch.nn.functional.normalize(h[-1], dim=0)
                                for h in llama_hidden])
        mean = llm.embed(prompts, PoolingParams(pooling_type="mean", normalize=False))
        _close(_vectors(mean), [h.mean(0) for h in llama_hidden])
        # vLLM's token_embed: every token's state, the chunks' rows in prompt order.
        every = llm.encode(prompts, PoolingParams(normalize=False))
        _close([o.outputs.data for o in every], llama_hidden)
        assert [o.prompt_token_ids for o in last] == prompts
        assert all(o.finished for o in last + mean)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_qwen2_dimensions_and_normalize(tiny_qwen2_dir) -> None:
    prompts = prompts_of_mixed_lengths(4)
    hidden = hf_hidden(tiny_qwen2_dir, prompts)
    llm = LLM(model=tiny_qwen2_dir, num_gpu_blocks=64)
    try:
        raw = llm.embed(prompts, PoolingParams(normalize=False))
        _close(_vectors(raw), [h[-1] for h in hidden])
        cut = llm.embed(prompts, PoolingParams(dimensions=8))
        _close(_vectors(cut), [torch.nn.functional.normalize(h[-1][:8], dim=0)
                               for h in hidden])
        assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5
                   for o in cut)
    finally:
        llm.shutdown()


def test_prefix_hits_and_mixed_batches_change_nothing(tiny_llama_dir, llama_hidden) -> None:
    """Last pooling reuses cached prompt blocks; embedding and generation requests share
    steps and neither changes the other's result."""
    prompts = prompts_of_mixed_lengths()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=256)
    try:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        hits = llm.engine.scheduler.kv.prefix_hits
        every = llm.encode(prompts, PoolingParams(normalize=False))  # reads every token:
        assert llm.engine.scheduler.kv.prefix_hits == hits  # no prompt block is skipped
        _close([o.outputs.data for o in every], llama_hidden)
        again = llm.embed(prompts)  # the generation left these prompts' blocks cached
        assert llm.engine.scheduler.kv.prefix_hits > hits
        _close(_vectors(again), [torch.nn.functional.normalize(h[-1], dim=0)
                                 for h in llama_hidden])
        other = [[t + 1 for t in p] for p in prompts]  # no cache hits: one mixed batch
        eng = llm.engine
        gen_ids = [eng.add_request(p, greedy) for p in prompts[::-1]]
        emb_ids = [eng.add_request(p, SamplingParams(max_tokens=1),
                                   pooling_params=PoolingParams("mean", False))
                   for p in other]
        done = {}
        mixed_steps = 0
        while eng.has_unfinished_requests():
            plan = eng.schedule()
            kinds = {r.pooling is not None for r in plan.scheduled}
            mixed_steps += kinds == {True, False}
            for o in eng.process(plan, eng.execute(plan)):
                if o.finished:
                    done[o.request_id] = o
        assert mixed_steps > 0
        assert [done[i].outputs[0].token_ids for i in gen_ids] == alone[::-1]
        _close([torch.tensor(done[i].embedding) for i in emb_ids],
               [h.mean(0) for h in hf_hidden(tiny_llama_dir, other)])
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_recompute_preemption_restarts_the_mean(tiny_llama_dir) -> None:
    """A tiny pool: a growing generation preempts a chunked mean-pooled prompt midway,
    which then runs again from position 0 (its partial sum restarts)."""
    prompt = [(13 * j) % 3000 + 7 for j in range(64)]
    want = hf_hidden(tiny_llama_dir, [prompt])[0].mean(0)
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=5, preemption_mode="recompute",
              num_cpu_blocks=0, max_num_batched_tokens=17, max_num_seqs=2)
    try:
        eng = llm.engine
        gen = eng.add_request(list(range(100, 115)),
                              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        emb = eng.add_request(prompt, SamplingParams(max_tokens=1),
                              pooling_params=PoolingParams("mean", False))
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        assert eng.scheduler.num_preemptions["recompute"] > 0
        assert len(done[gen].outputs[0].token_ids) == 40
        _close([torch.tensor(done[emb].embedding)], [want])
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bad_embedding_requests_raise_value_errors(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=32, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed([[5, 6, 7]], PoolingParams(dimensions=10**6))
        with pytest.raises(ValueError, match="pooling_type"):
            PoolingParams(pooling_type="max")
        with pytest.raises(ValueError, match="dimensions"):
            PoolingParams(dimensions=0)
        with pytest.raises(ValueError, match="pooling_type 'mean' does not apply"):
            PoolingParams(pooling_type="mean", task="token_embed")
        with pytest.raises(ValueError, match="pooling_type 'all' does not apply"):
            llm.embed([[5, 6]], PoolingParams(pooling_type="all"))
        with pytest.raises(ValueError, match="needs a sequence classifier"):
            llm.encode([[5, 6]], pooling_task="token_classify")
        with pytest.raises(ValueError, match="context"):
            llm.embed([list(range(5, 70))])
        with pytest.raises(ValueError, match="n must be 1"):
            llm.engine.add_request([5, 6], SamplingParams(n=2), pooling_params=PoolingParams())
        full = llm.embed([list(range(5, 69))])  # exactly the context: nothing is generated
        assert len(full[0].outputs.embedding) == llm.engine.model_info["hidden_size"]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_score_is_the_cosine_of_the_embeddings(tiny_llama_dir) -> None:
    """vLLM's ``LLM.score`` for embedding models: one text against several, or two
    lists pairwise; a text against itself scores 1."""
    texts = ["t5 t6 t7", "t9 t10 t11 t12", "t5 t6 t8"]
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=32)
    try:
        vecs = _vectors(llm.embed(texts))
        got = llm.score(texts[0], texts)
        assert [o.outputs.score for o in got] == pytest.approx(
            [float(vecs[0] @ v) for v in vecs], abs=1e-5)
        assert got[0].outputs.score == pytest.approx(1.0, abs=1e-5)
        tok = llm.get_tokenizer()
        assert got[1].prompt_token_ids == tok.encode(texts[0]) + tok.encode(texts[1])
        pair = llm.score(texts[:2], texts[1:])
        assert [o.outputs.score for o in pair] == pytest.approx(
            [float(vecs[0] @ vecs[1]), float(vecs[1] @ vecs[2])], abs=1e-5)
        for a, b, name in ((texts[:2], texts, "data_1"), ("x", [], "data_2"),
                           ("", "x", "data_1")):
            with pytest.raises(ValueError, match=name):
                llm.score(a, b)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_base_model_checkpoints_serve_embeddings_only(tmp_path, default_model_dir,
                                                      kind: str) -> None:
    """``LlamaModel`` / ``Qwen3Model`` checkpoints (bare names, no LM head; how e5-mistral
    or Qwen3-Embedding are saved) load and embed; generating is a clear error."""
    from pagedserve.worker.testing import write_random_checkpoint

    extra = {"head_dim": 32} if kind == "qwen3" else {}
    path = write_random_checkpoint(tmp_path / kind, kind, default_model_dir, base_model=True,
                                   **extra)
    prompts = prompts_of_mixed_lengths(4)
    hidden = hf_hidden(path, prompts)
    llm = LLM(model=path, num_gpu_blocks=64)
    try:
        assert llm.engine.model_info["embedding_only"]
        _close(_vectors(llm.embed(prompts)),
               [torch.nn.functional.normalize(h[-1], dim=0) for h in hidden])
        with pytest.raises(ValueError, match="embedding model"):
            llm.generate(prompts[:1], SamplingParams(max_tokens=2))
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
