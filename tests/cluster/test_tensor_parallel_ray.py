"""TP=2 over Ray actors (gloo) gives the same tokens as TP=1; a killed rank fails
the engine cleanly (every request ended, pool back at baseline); batch invariance
holds at TP=2 and TP=4."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.cluster import LLM, LoRARequest, PoolingParams, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from pagedserve.worker.testing_eagle import write_guessing_pair
from pagedserve.worker.testing_mtp import write_guessing_mtp_model
from pagedserve.worker.testing_qwen3_next_mtp import add_random_qwen3_next_mtp
from tests.cluster.conftest import hf_greedy
from tests.cluster.lora_fixtures import GREEDY, make_llama_adapters, mixed_batch, write_adapter
from tests.cluster.test_eagle import assert_every_guess_kept
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def test_tp2_equals_tp1(ray_cluster, tiny_llama_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = prompts_of_mixed_lengths()
    # Penalty rows carry their prompt and output history (sent to ranks as changes).
    pen = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                         repetition_penalty=1.3, presence_penalty=0.5)
    tp1 = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
        ref_pen = [o.outputs[0].token_ids for o in tp1.generate(prompts, pen)]
        ref_emb = [o.outputs.embedding for o in tp1.embed(prompts, PoolingParams("mean"))]
    finally:
        tp1.shutdown()
    tp2 = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=64,
              num_threads=1)
    try:
        assert tp2.engine.model_info["tensor_parallel_size"] == 2
        outs = tp2.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        # The ranks got those plans as changes (scheduler/plan_wire.py), and decoded them.
        assert tp2.engine.executor._wire._number >= 16
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, pen)] == ref_pen
        assert ref_pen != ref  # the penalties changed the answers
        # Seeded sampling happens on rank 0 only; every rank still runs the forward.
        sampled = tp2.generate(prompts, SamplingParams(temperature=0.8, seed=3,
                                                        max_tokens=8, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in sampled)
        # Embeddings: every rank holds the whole final hidden state; rank 0 pools it.
        emb = [o.outputs.embedding for o in tp2.embed(prompts, PoolingParams("mean"))]
        assert all(max(abs(a - b) for a, b in zip(x, y, strict=True)) < 1e-5
                   for x, y in zip(emb, ref_emb, strict=True))
        assert_pool_at_baseline(tp2)
    finally:
        tp2.shutdown()


def test_tp2_prompt_embeds_and_logits_processors_equal_hugging_face(ray_cluster,
                                                                   tiny_llama_dir) -> None:
    """Embedding rows travel to every rank in the plan; processors are built and run
    on rank 0 only, over the history the plan carries."""
    from tests.cluster.test_prompt_embeds import IDS, hf_embeds, hf_generate_embeds

    embeds, model = hf_embeds(tiny_llama_dir, IDS)
    want = [hf_generate_embeds(model, e, 10) for e in embeds]
    want_ngram = hf_greedy(tiny_llama_dir, IDS, 10, no_repeat_ngram_size=2)
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=64, num_threads=1,
              enable_prompt_embeds=True, block_size=16, max_num_batched_tokens=20,
              logits_processors=["pagedserve.worker.testing_logits:NoRepeatNgramProcessor"])
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_embeds": e} for e in embeds], greedy)
        assert [o.outputs[0].token_ids for o in outs] == want
        ngram = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                               extra_args={"no_repeat_ngram_size": 2})
        outs = llm.generate([{"prompt_token_ids": ids} for ids in IDS], ngram)
        assert [o.outputs[0].token_ids for o in outs] == want_ngram
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_tp2_expert_parallel_equals_hugging_face(ray_cluster, tiny_qwen3_moe_dir,
                                                 tiny_mixtral_dir) -> None:
    """``enable_expert_parallel`` reaches the ranks: each holds whole experts (every
    other one, round robin), chunked prompts and decode give HF's greedy tokens, and
    rank 0's count of each rank's routed pairs reaches the stats; more ranks than
    experts is refused on the driver, before any rank starts."""
    prompts = prompts_of_mixed_lengths(6)
    llm = LLM(model=tiny_qwen3_moe_dir, tensor_parallel_size=2, num_gpu_blocks=64,
              num_threads=1, enable_expert_parallel=True,
              expert_placement_strategy="round_robin", max_num_batched_tokens=32)
    try:
        assert llm.engine.model_info["expert_parallel"]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_qwen3_moe_dir,
                                                                   prompts, 12)
        # Rank 0 counted every rank's pairs: 3 for each token the one routed layer ran
        # (every prompt token, and 11 of each answer's 12: the last is never fed back).
        stats = llm.engine.get_stats()
        assert stats["expert_parallel_routed_pairs"] == 3 * (sum(map(len, prompts)) + 6 * 11)
        assert 0.5 <= stats["expert_parallel_balance"] <= 1.0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="4 routed experts cannot give each of 8 ranks"):
        LLM(model=tiny_mixtral_dir, tensor_parallel_size=8, enable_expert_parallel=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_batch_invariant_probe_in_a_crowd_equals_probe_alone(
        ray_cluster, tmp_path, default_model_dir, tp: int) -> None:
    """Each rank pads its GEMM rows and attends per row; two ranks' partial sums add
    in one order, and over four the all-reduces add the gathered partials in rank
    order, so a request's logprobs keep their bits whatever shares its steps.
    (A 1024-wide model: at 512, split over two ranks, the default mode gave this probe
    the same bits in the crowd too, and the test could not fail.)"""
    from pagedserve.worker.testing import write_random_checkpoint
    from tests.cluster.test_batch_invariance import GREEDY, PROBE, assert_same, crowd, run

    model = write_random_checkpoint(tmp_path, "llama", default_model_dir, hidden_size=1024,
                                    intermediate_size=3072, num_attention_heads=16,
                                    num_key_value_heads=8)
    llm = LLM(model=model, tensor_parallel_size=tp, num_gpu_blocks=128,
              num_threads=1, batch_invariant=True, max_num_batched_tokens=64)
    try:
        alone = run(llm.engine, [(0, "probe", PROBE, GREEDY, {})])["probe"]
        assert_same(run(llm.engine, crowd(GREEDY))["probe"], alone)
    finally:
        llm.shutdown()


def test_tp2_shared_prefix_decode_equals_hugging_face(ray_cluster, tiny_llama_dir) -> None:
    """Each rank splits its heads' decode attention over the cached system prompt
    (``kernels.cpu_cascade``) from the same block tables; the tokens stay HF's."""
    from tests.cluster.test_shared_prefix_decode import GREEDY, SYSTEM, TAILS

    prompts = [SYSTEM + t for t in TAILS]
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=128,
              num_threads=1)
    try:
        llm.generate([{"prompt_token_ids": SYSTEM}], SamplingParams(max_tokens=1))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama_dir, prompts, 12)
        # Rank 0's counts come back with its sampled tokens, once per step.
        stats = llm.engine.get_stats()
        steps, rows = stats["shared_prefix_steps"], stats["shared_prefix_rows"]
        assert steps >= 11 and stats["shared_prefix_keys_saved"] == 320 * (rows - steps)
    finally:
        llm.shutdown()


def test_tp2_with_speculative_decoding_equals_hugging_face(ray_cluster, tiny_llama_dir) -> None:
    """Drafted rows travel in the broadcast plan; only rank 0 verifies them."""
    prompts = [list(range(100 + 9 * i, 108 + 9 * i)) * (2 + i) for i in range(3)]
    prompts += prompts_of_mixed_lengths(3)
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=64, num_threads=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama_dir, prompts, 16)
        assert llm.engine.get_stats()["spec_decode"]["num_drafts"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_tp2_qwen3_next_mtp_drafts_and_every_rank_rolls_back(ray_cluster, tmp_path,
                                                             default_model_dir) -> None:
    """Rank 0 holds the MTP module with its own copies of the embedding and LM head;
    each rank keeps its share of the DeltaNet states after every guess, and the plan
    after a rejection names how many were kept, so every rank puts its state back."""
    path = add_random_qwen3_next_mtp(write_random_checkpoint(
        tmp_path / "qwen3_next", "qwen3_next", default_model_dir, num_key_value_heads=2))
    prompts = prompts_of_mixed_lengths(5)
    ref = hf_greedy(path, prompts, 16)
    llm = LLM(model=path, tensor_parallel_size=2, num_gpu_blocks=128, block_size=4,
              num_threads=1, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == ref
        s = llm.engine.get_stats()["spec_decode"]
        assert 0 <= s["num_accepted_tokens"] < s["num_draft_tokens"], s
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_tp2_eagle_head_reads_its_own_copy_of_the_embedding_and_head(
        ray_cluster, default_model_dir, tmp_path) -> None:
    """Rank 0 drafts alone, so under TP its head loads the target's embedding and LM
    head whole from the checkpoint: a head that guesses right keeps every guess."""
    target, head = write_guessing_pair(tmp_path, default_model_dir)
    assert_every_guess_kept(LLM(model=target, tensor_parallel_size=2, num_gpu_blocks=64,
                                num_threads=1, speculative_config={
                                    "method": "eagle", "model": head,
                                    "num_speculative_tokens": 3}),
                            target, prompts_of_mixed_lengths(4), 16)


def test_tp2_mtp_layer_drafts_on_rank_zero(ray_cluster, default_model_dir, tmp_path) -> None:
    """DeepSeek-V3's own MTP layer drafts on rank 0 alone, whole (its embedding and head
    read from the checkpoint, not the ranks' vocabulary shards): a layer that guesses
    right keeps every guess, and the tokens are HF's."""
    model = write_guessing_mtp_model(tmp_path / "v3", default_model_dir, num_hidden_layers=2,
                                     num_key_value_heads=4, max_position_embeddings=256)
    prompts = prompts_of_mixed_lengths(4)
    assert_every_guess_kept(LLM(model=model, tensor_parallel_size=2, num_gpu_blocks=64,
                                num_threads=1, speculative_config={
                                    "method": "deepseek_mtp", "num_speculative_tokens": 2}),
                            model, prompts, 16)


def test_tp2_with_lora_adapters_equals_tp1(ray_cluster, tiny_llama_dir, tmp_path) -> None:
    """Each rank holds its shard of every adapter (B's rows for q/k/v and gate/up, A's
    columns for o and down); an adapter a rank refuses is a ValueError, not a dead group."""
    loras = [None, *make_llama_adapters(tmp_path, tiny_llama_dir).values()]
    prompts, per_prompt = mixed_batch(loras)
    kw = dict(model=tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks=64)
    tp1 = LLM(**kw)
    try:
        ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY,
                                                            lora_request=per_prompt)]
    finally:
        tp1.shutdown()
    tp2 = LLM(**kw, tensor_parallel_size=2, num_threads=1)
    try:
        outs = tp2.generate(prompts, GREEDY, lora_request=per_prompt)
        assert [o.outputs[0].token_ids for o in outs] == ref
        big = write_adapter(tiny_llama_dir, tmp_path / "r16", 6, ["q_proj"], r=16)
        with pytest.raises(ValueError, match="max_lora_rank"):
            tp2.generate(prompts[:1], GREEDY, lora_request=LoRARequest("big", 9, big))
        tp2.engine.check_health()
        assert tp2.engine.remove_lora(loras[1].lora_name)
        outs = tp2.generate(prompts[:8], GREEDY, lora_request=per_prompt[:8])
        assert [o.outputs[0].token_ids for o in outs] == ref[:8]
        assert_pool_at_baseline(tp2)
    finally:
        tp2.shutdown()


def test_tp2_kv_transfer_ships_each_rank_its_own_shard(ray_cluster, tiny_llama_dir) -> None:
    """A TP=2 prefill engine's K/V, imported by another TP=2 engine rank by rank, give
    TP=1's tokens; a TP=1 engine refuses them (its blocks hold every KV head)."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = prompts_of_mixed_lengths(4)
    tp1 = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
        kw = dict(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=64,
                  num_threads=1)
        src = LLM(**kw)
        try:
            payloads = prefill(src, prompts)
        finally:
            src.shutdown()
        assert all(len(p.shards) == 2 for p in payloads if p.num_blocks)
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            import_prompt_kv(tp1.engine, next(p for p in payloads if p.num_blocks))
        dst = LLM(**kw)
        try:
            assert sum(import_prompt_kv(dst.engine, p) for p in payloads) > 0
            outs = dst.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == ref
            assert sum(o.num_cached_tokens for o in outs) > 0
            assert_pool_at_baseline(dst)
        finally:
            dst.shutdown()
    finally:
        tp1.shutdown()


def test_tp2_import_offloads_what_it_evicts_on_every_rank(ray_cluster, tiny_llama_dir) -> None:
    """With KV offloading, a TP=2 import into a full pool first copies the prefix it
    evicts to each rank's CPU tier (a cache-ops-only plan broadcast to the ranks), so
    the evicted prompt then hits every block with TP=1's tokens."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(model=tiny_llama_dir, tensor_parallel_size=2, num_threads=1)
    src = LLM(**kw, num_gpu_blocks=64)
    try:
        B = src.engine.scheduler.block_size
        first = [(17 * j) % 3000 + 500 for j in range(4 * B + 3)]
        other = [(19 * j) % 3000 + 700 for j in range(7 * B + 1)]
        ref = src.generate([first], params)[0].outputs[0].token_ids
        (payload,) = prefill(src, [other])
    finally:
        src.shutdown()
    dst = LLM(**kw, num_gpu_blocks=8, num_offload_blocks=16)
    try:
        assert dst.generate([first], params)[0].outputs[0].token_ids == ref
        assert import_prompt_kv(dst.engine, payload) == 7
        again = dst.generate([first], params)[0]
        assert again.outputs[0].token_ids == ref and again.num_cached_tokens == 4 * B
        assert dst.engine.get_stats()["kv_offload"]["cpu_hit_tokens"] >= 3 * B
        assert_pool_at_baseline(dst)
    finally:
        dst.shutdown()


def test_tp2_sleep_and_new_weights_on_every_rank(ray_cluster, tiny_llama_dir, tmp_path
                                                 ) -> None:
    """Each rank frees its shard asleep, reloads its shard of the new checkpoint, and the
    group gives TP=1's tokens for each set of weights."""
    from pagedserve.worker.testing import write_random_checkpoint

    other = write_random_checkpoint(tmp_path / "other", "llama", None, seed=99)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = prompts_of_mixed_lengths(4)
    refs = {}
    for path in (tiny_llama_dir, other):
        tp1 = LLM(model=path, num_gpu_blocks=64)
        try:
            refs[path] = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
        finally:
            tp1.shutdown()
    tp2 = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=64,
              num_threads=1)
    try:
        tp2.sleep(2)
        tp2.engine.check_health()
        tp2.update_weights(other)
        tp2.wake_up()
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params)] == refs[other]
        tp2.update_weights(tiny_llama_dir)
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params)] == \
            refs[tiny_llama_dir]
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            tp2.sleep(5)
        assert_pool_at_baseline(tp2)
    finally:
        tp2.shutdown()


def test_killed_rank_fails_requests_and_frees_the_pool(ray_cluster, tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=64, num_threads=1)
    try:
        engine = llm.engine
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=100, ignore_eos=True),
                           request_id="victim")
        engine.step()
        ray.kill(engine.executor.workers[1])
        with pytest.raises(Exception, match="tensor-parallel group failed"):
            for _ in range(50):
                engine.step()
        engine.fail_all(RuntimeError("rank died"))
        assert_pool_at_baseline(llm)
        with pytest.raises(RuntimeError, match="dead"):
            engine.check_health()
    finally:
        llm.shutdown()


def test_tp2_with_kv_offloading_equals_tp1(ray_cluster, tiny_llama_dir) -> None:
    """Each rank keeps its own shard of the CPU tier; the offload copies and loads
    travel in the broadcast plan like swaps."""
    from tests.cluster.test_kv_offload import conversations, run

    tp1 = LLM(model=tiny_llama_dir, num_gpu_blocks=256, enable_prefix_caching=False)
    try:
        ref = run(tp1, conversations())
    finally:
        tp1.shutdown()
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks=10,
              num_offload_blocks=40, block_size=16, num_threads=1)
    try:
        assert run(llm, conversations()) == ref
        assert llm.engine.get_stats()["kv_offload"]["loaded_blocks"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}])
def test_sharded_classifier_equals_hugging_face(ray_cluster, tmp_path, layout) -> None:
    """Each TP rank holds the whole ``score`` head and rank 0 applies it; under PP the
    last stage holds it beside the tied head it never runs."""
    from pagedserve.worker.testing import write_random_checkpoint
    from tests.cluster.test_classifier import LABELS, PROMPTS, _close, _hf_logits

    path = write_random_checkpoint(tmp_path / "cls", "qwen2", classifier=True,
                                   id2label=LABELS, vocab_size=512)
    want = [torch.softmax(x, -1) for x in _hf_logits(path, PROMPTS)]
    llm = LLM(model=path, num_gpu_blocks=64, num_threads=1, block_size=16,
              max_num_batched_tokens=16, **layout)
    try:
        for o, w in zip(llm.classify(PROMPTS), want, strict=True):
            _close(o.outputs.probs, w)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["bert", "modernbert", "splade", "colbert"])
def test_tp2_encoder_cross_encoder_equals_transformers(ray_cluster, tmp_path, family) -> None:
    """An encoder's scores over two ranks: q/k/v, the MLP input and the word embedding
    split, the row-parallel biases added once, the head whole on rank 0. The BERT
    cross-encoder reads ``[CLS]``; the ModernBERT one (RoPE, local layers, GeGLU split
    as input and gate halves) pools every token's mean; the SPLADE encoder's head
    decodes through the whole word embedding, and its score is a dot product; the
    ColBERT's projection is whole on rank 0, its score MaxSim over token vectors."""
    from pagedserve.worker.testing_encoders import (
        hf_encoder_outputs,
        hf_splade_vectors,
        write_random_encoder,
    )
    from tests.cluster.test_encoders import DOCS, QUERY

    if family == "colbert":
        from pagedserve.worker.testing_encoders import (
            hf_multi_vector_outputs,
            write_random_multi_vector,
        )

        path = write_random_multi_vector(tmp_path / "colbert", "colbert", dim=12, seed=4)
        rows = [v["token_embed"] for v in hf_multi_vector_outputs(path, "colbert",
                                                                   [QUERY, *DOCS])]
        want, tol = [(rows[0] @ d.T).amax(-1).sum() for d in rows[1:]], 1e-4
    elif family == "splade":
        path = write_random_encoder(tmp_path / "splade", "bert", splade="max", seed=4)
        vecs = hf_splade_vectors(path, [QUERY, *DOCS])
        want, tol = [vecs[0] @ v for v in vecs[1:]], 1e-4
    else:
        extra = {"classifier_pooling": "mean"} if family == "modernbert" else {}
        path = write_random_encoder(tmp_path / "cross", family, num_labels=1, seed=4, **extra)
        want = [torch.sigmoid(x)
                for x in hf_encoder_outputs(path, [(QUERY, d) for d in DOCS], True)]
        tol = 2e-5
    llm = LLM(model=path, tensor_parallel_size=2, num_threads=1)
    try:
        for s, w in zip(llm.score(QUERY, DOCS), want, strict=True):
            assert abs(s.outputs.score - w.item()) <= tol * max(1.0, abs(w.item()))
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
