"""Speculative decoding with a draft model through the real engine.

Greedy outputs equal Hugging Face's whatever the draft (the target's own weights,
which it accepts almost always, or an unrelated model, which it mostly rejects),
under chunked prefill, both preemption modes, prefix-cache hits, ``n > 1`` and
aborts; seeded sampling draws what it draws without drafts; the pool returns to its
baseline; bad drafts are a ``ValueError`` naming ``speculative_config.model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

K = 3


def _spec(model: str, **kw) -> dict:
    return {"model": model, "num_speculative_tokens": K, **kw}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _acceptance(llm: LLM, before: dict | None = None) -> float:
    s = llm.engine.get_stats()["spec_decode"]
    b = before or {"num_draft_tokens": 0, "num_accepted_tokens": 0}
    sent = s["num_draft_tokens"] - b["num_draft_tokens"]
    assert sent > 0, s
    return (s["num_accepted_tokens"] - b["num_accepted_tokens"]) / sent


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """Same shape and tokenizer as ``tiny_llama_dir``, other weights, one layer."""
    return write_random_checkpoint(tmp_path_factory.mktemp("draft"), "llama",
                                   default_model_dir, seed=99, num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, prompts_of_mixed_lengths(), 24)


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prompts: the draft catches up chunk by chunk
    {"num_gpu_blocks": 20, "preemption_mode": "recompute"},
    {"num_gpu_blocks": 24, "preemption_mode": "swap"},
])
def test_self_draft_greedy_equals_hugging_face_and_is_accepted(tiny_llama_dir, reference,
                                                                kw) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, block_size=4, max_num_seqs=8,
              **{"num_gpu_blocks": 64, **kw}, speculative_config=_spec(tiny_llama_dir))
    try:
        steps0 = llm.engine.stats["steps"]
        assert _tokens(llm.generate(prompts_of_mixed_lengths(), params)) == reference
        # The draft's KV is right after every chunk, recompute and swap: its guesses
        # are the target's own, so nearly all are kept (fp rounding may flip a tie).
        assert _acceptance(llm) > 0.95
        stats = llm.engine.get_stats()
        if "preemption_mode" in kw:
            assert sum(stats["num_preemptions"].values()) > 0
        # Each drafted step advances a row by most of its K guesses and its own token.
        spec = stats["spec_decode"]
        assert spec["num_accepted_tokens"] >= 2 * spec["num_drafts"], spec
        if not kw:  # (plain decoding takes 24 steps at least)
            assert llm.engine.stats["steps"] - steps0 < 16
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_unrelated_draft_changes_no_token(tiny_llama_dir, other_draft, reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
              speculative_config=_spec(other_draft))
    try:
        assert _tokens(llm.generate(prompts_of_mixed_lengths(), params)) == reference
        assert _acceptance(llm) < 0.5  # the draft really is another model
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_prefix_cache_hits_keep_the_drafts_kv(tiny_llama_dir) -> None:
    prompt = list(range(200, 260))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
              speculative_config=_spec(tiny_llama_dir))
    try:
        first = llm.generate([prompt], params)[0]
        before = llm.engine.get_stats()["spec_decode"]
        again = llm.generate([[*prompt, 7]], params)[0]
        assert again.num_cached_tokens >= 56
        # Only the draft's KV of the cached blocks lets it guess right after a hit.
        assert _acceptance(llm, before) > 0.95
        assert first.outputs[0].token_ids  # (ran)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def plain_seeded(tiny_llama_dir) -> Iterator[tuple]:
    prompts = [list(range(100 + 9 * i, 120 + 9 * i)) for i in range(4)]
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        yield prompts, llm.generate(prompts, _seeded()), llm.generate(prompts, _penal())
    finally:
        llm.shutdown()


def _seeded() -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=30, seed=5, max_tokens=20, ignore_eos=True,
                          n=2)


def _penal() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                          repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=5)


def test_seeded_sampling_penalties_and_n2_draw_as_without_drafts(tiny_llama_dir,
                                                                  plain_seeded) -> None:
    prompts, seeded, penal = plain_seeded
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64,
              speculative_config=_spec(tiny_llama_dir))
    try:
        got = llm.generate(prompts, _seeded())
        assert [[c.token_ids for c in o.outputs] for o in got] == \
            [[c.token_ids for c in o.outputs] for o in seeded]
        assert _tokens(llm.generate(prompts, _penal())) == _tokens(penal)
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_abort_mid_decode_frees_the_lookahead_too(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
              speculative_config=_spec(tiny_llama_dir))
    try:
        engine = llm.engine
        for i, p in enumerate(prompts_of_mixed_lengths(4)):
            engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True,
                                                 temperature=0.0), request_id=f"r{i}")
        for _ in range(4):
            engine.step()
        assert engine.get_stats()["spec_decode"]["num_drafts"] > 0
        for i in range(4):
            assert engine.abort_request(f"r{i}")
        assert_pool_at_baseline(llm)
        plan = engine.schedule()
        engine.process(plan, engine.execute(plan))
    finally:
        llm.shutdown()


def test_bad_drafts_are_value_errors_naming_the_field(tmp_path, tiny_llama_dir,
                                                      default_model_dir) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(model=tiny_llama_dir, num_gpu_blocks=16,
            speculative_config=_spec(str(tmp_path / "missing")))
    big = write_random_checkpoint(tmp_path / "big", "llama", default_model_dir,
                                  vocab_size=50000)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocabulary"):
        LLM(model=tiny_llama_dir, num_gpu_blocks=16, speculative_config=_spec(big))
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(model=tiny_llama_dir, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="draft_model"):
        LLM(model=tiny_llama_dir, speculative_config={"method": "ngram", "model": big})
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=tiny_llama_dir, speculative_config=_spec(big, quantization="fp8"))
    windowed = write_random_checkpoint(tmp_path / "win", "mistral", default_model_dir,
                                       sliding_window=64)
    with pytest.raises(ValueError, match="keeps only its sliding window of 64"):
        LLM(model=windowed, num_gpu_blocks=16, speculative_config=_spec(tiny_llama_dir))


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_sliding_window_targets_and_drafts(tmp_path, tiny_gemma3_dir, default_model_dir,
                                           kind) -> None:
    """Gemma 3 (hybrid: the draft reads the full layers' table, its sliding layers
    mask their own window) and Mistral past its window (blocks behind it released:
    a draft with the same window never reads them), each drafted by itself."""
    if kind == "gemma3":
        model = tiny_gemma3_dir
    else:
        model = write_random_checkpoint(tmp_path / "mistral", "mistral", default_model_dir,
                                        sliding_window=12)
    prompts = prompts_of_mixed_lengths()
    llm = LLM(model=model, block_size=4, num_gpu_blocks=96, speculative_config=_spec(model))
    try:
        got = _tokens(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                           ignore_eos=True)))
        assert got == hf_greedy(model, prompts, 24)
        assert _acceptance(llm) > 0.95
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_default_model_with_a_quantised_copy_as_draft(smol_llm, default_model_dir,
                                                      quantization: str) -> None:
    """Real weights and tokenizer: SmolLM2 drafted by its own int8 (int4) copy gives plain
    decoding's greedy answers, JSON under a schema included (the grammar masks each
    guessed position), with most guesses kept."""
    from pagedserve.scheduler.sampling_params import StructuredOutputs

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a haiku about paged memory."}]]
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputs(json=schema))]
    llm = LLM(num_gpu_blocks=256, speculative_config=_spec(default_model_dir,
                                                           quantization=quantization))
    try:
        for p in params:
            for m in chats:
                a = llm.chat(m, p)[0].outputs[0]
                b = smol_llm.chat(m, p)[0].outputs[0]
                assert (a.token_ids, a.text) == (b.token_ids, b.text)
                if p.logprobs:
                    assert all(abs(la[t] - lb[t]) < 1e-3
                               for la, lb in zip(a.logprobs, b.logprobs) for t in la)
        assert _acceptance(llm) > 0.4  # (the draft knows no grammar: JSON guesses miss more)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_sampled_rows_draft_from_q_and_keep_most_guesses(tiny_llama_dir) -> None:
    """At temperature 1.5 a row that samples unseeded gets guesses drawn from the
    draft's own distribution, verified by speculative sampling's rule: a draft with
    the target's weights keeps nearly all of them. Seeded rows keep greedy guesses
    (their tokens those without drafts), which survive far less often."""
    prompts = [list(range(300 + 11 * i, 330 + 11 * i)) for i in range(4)]
    llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=128,
              speculative_config=_spec(tiny_llama_dir))
    try:
        hot = SamplingParams(temperature=1.5, max_tokens=32, ignore_eos=True, logprobs=1)
        before = llm.engine.get_stats()["spec_decode"]
        outs = llm.generate(prompts, hot)
        by_q = _acceptance(llm, before)
        assert all(len(o.outputs[0].token_ids) == 32 == len(o.outputs[0].logprobs)
                   for o in outs)
        before = llm.engine.get_stats()["spec_decode"]
        llm.generate(prompts, SamplingParams(temperature=1.5, max_tokens=32,
                                             ignore_eos=True, seed=3))
        greedy = _acceptance(llm, before)
        assert by_q > 0.9 and by_q > greedy + 0.2, (by_q, greedy)
        assert not llm.engine.executor.worker.runner.drafter.probs  # none left behind
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("ship_draft", [True, False])
def test_shipped_prompt_kv_carries_the_drafts_kv(tiny_llama_dir, reference,
                                                 ship_draft: bool) -> None:
    """Disaggregated prefill: the prefill engine's payload holds its draft's K/V beside
    the target's, and a decode engine with the same draft writes both, so its guesses
    after the imported prefix are kept as often as on the engine that computed it.
    Without the draft's part the decode engine answers the same, guessing worse."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    prompts = prompts_of_mixed_lengths()
    spec = _spec(tiny_llama_dir)
    pre, dec = (LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=128,
                    speculative_config=spec) for _ in range(2))
    try:
        payloads = prefill(pre, prompts)
        assert all(len(s) == 4 for p in payloads for s in p.shards)  # K, V, draft K, V
        if not ship_draft:
            payloads = [dataclasses.replace(p, shards=[s[:2] for s in p.shards])
                        for p in payloads]
        assert sum(import_prompt_kv(dec.engine, p) for p in payloads) > 0
        outs = dec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True))
        assert _tokens(outs) == reference
        assert sum(o.num_cached_tokens for o in outs) > 0
        kept = _acceptance(dec)
        assert kept > 0.95 if ship_draft else kept < 0.8, kept
        for llm in (pre, dec):
            assert_pool_at_baseline(llm)
    finally:
        pre.shutdown()
        dec.shutdown()
