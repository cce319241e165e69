"""Speculative decoding with EAGLE and EAGLE-3 heads through the real engine.

Every guess the engine's head makes equals a dense drafter written from the papers'
equations (``eagle_reference``) fed by Hugging Face's target, through whole and
chunked prompts, prefix-cache hits and ``n > 1`` siblings: the features, the shift by
one token and the head's own KV line up. A head built to guess exactly what its
target says has every guess kept, under preemption of both kinds too; greedy
output equals decoding without a head; the pool returns to its baseline; bad heads
are ``ValueError``s naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing_eagle import write_guessing_pair, write_random_eagle
from tests.cluster.conftest import hf_greedy
from tests.cluster.eagle_reference import DenseHead
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

K = 3
AUX = [0, 1, 1]  # (the 2-layer target has no layers 2 and L - 3)


def _spec(method: str, head: str, **kw) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": K, **kw}


def _greedy(n: int = 24, count: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n=count)


def assert_every_guess_kept(llm: LLM, model: str, prompts: list[list[int]],
                            max_tokens: int) -> None:
    """Through ``llm`` (closed after), whose head was built to guess right: greedy tokens
    are HF's, over 95% of the guesses are kept, and the pool returns to its baseline."""
    try:
        outs = llm.generate(prompts, _greedy(max_tokens))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, max_tokens)
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_accepted_tokens"] > 0.95 * spec["num_draft_tokens"] > 0, spec
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def _plain_greedy(model: str, prompts: list[list[int]], params: SamplingParams
                  ) -> list[list[int]]:
    """The tokens the engine gives without guesses: what every head must reproduce."""
    plain = LLM(model=model, block_size=4, num_gpu_blocks=64)
    try:
        return [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()


def _prompts() -> list[list[int]]:
    return [list(range(300 + 11 * i, 300 + 11 * i + 3 + 5 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> tuple[str, str]:
    return write_guessing_pair(tmp_path_factory.mktemp("eagle_pair"), default_model_dir)


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle_heads")
    return {"eagle": write_random_eagle(root / "e1", tiny_llama_dir, "eagle", seed=3),
            "eagle3": write_random_eagle(root / "e3", tiny_llama_dir, "eagle3", seed=4,
                                         draft_vocab=4096, aux_layers=AUX)}


def _record(llm: LLM) -> list[tuple[str, int, list[int]]]:
    """Wrap the head's runner: each proposal as (request id, sequence length, guesses)."""
    runner = llm.engine.executor.worker.runner.drafter
    seen: list[tuple[str, int, list[int]]] = []
    run = runner.run

    def recording(plan, out, hidden=None):
        got = run(plan, out, hidden)
        for r in plan.scheduled:
            if r.request_id in got:
                kept = out.spec_tokens.get(r.request_id)
                n = len(kept) if r.draft_token_ids else len(r.token_ids)
                seen.append((r.request_id, r.num_computed_tokens + n + 1, got[r.request_id]))
        return got

    runner.run = recording
    return seen


def guesses_of_three_runs(llm: LLM) -> list[tuple[list[int], int, list[int]]]:
    """Through ``llm`` (closed after): a 21-token prompt, then a prefix-cache hit on it
    (the head's KV of the cached blocks is the first run's), then two greedy siblings
    that share the prompt's last feature. Every proposal as (the whole sequence its
    request produced, the length it had, the guesses)."""
    prompt = list(range(500, 521))
    try:
        seen = _record(llm)
        first = llm.generate([prompt], _greedy(6))[0].outputs[0].token_ids
        hit = llm.generate([[*prompt, 7]], _greedy(6))[0]
        assert hit.num_cached_tokens >= 16
        twins = llm.generate([[*prompt, 9]], _greedy(5, count=2))[0].outputs
        assert twins[0].token_ids == twins[1].token_ids
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    full = {0: prompt + first, 1: [*prompt, 7, *hit.outputs[0].token_ids],
            2: [*prompt, 9, *twins[0].token_ids]}
    # Requests in the order they first proposed: the prompt, the hit, then both twins.
    firsts = list(dict.fromkeys(rid for rid, _, _ in seen))
    assert len(firsts) == 4, firsts
    seq_of = {rid: full[min(i, 2)] for i, rid in enumerate(firsts)}
    return [(seq_of[rid], length, guesses) for rid, length, guesses in seen]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}])
def test_every_guess_equals_the_dense_reference(tiny_llama_dir, heads, method, kw) -> None:
    seen = guesses_of_three_runs(LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
                                     **kw, speculative_config=_spec(method, heads[method])))
    dense = DenseHead(heads[method], tiny_llama_dir, method)
    aux = AUX if method == "eagle3" else None
    assert len(seen) >= 12
    for seq, length, guesses in seen:
        assert guesses == dense.propose(tiny_llama_dir, seq[:length], K, aux), length


def test_a_pytorch_bin_head_drafts_as_its_safetensors_copy(tiny_llama_dir, tmp_path) -> None:
    """Most released heads are ``pytorch_model.bin``: read, memory-mapped, it drafts
    exactly as the same head in safetensors."""
    prompt = list(range(700, 719))
    guesses = []
    for fmt in (True, False):
        head = write_random_eagle(tmp_path / str(fmt), tiny_llama_dir, "eagle3", seed=8,
                                  draft_vocab=2048, aux_layers=AUX, safetensors=fmt)
        llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
                  speculative_config=_spec("eagle3", head))
        try:
            seen = _record(llm)
            llm.generate([prompt], _greedy(8))
            guesses.append(seen)
        finally:
            llm.shutdown()
    assert guesses[0] == guesses[1] and guesses[0]


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8},
    {"num_gpu_blocks": 20, "preemption_mode": "recompute"},
    {"num_gpu_blocks": 24, "preemption_mode": "swap"},
])
def test_a_head_that_guesses_right_is_always_kept(pair, kw) -> None:
    target, head = pair
    params = _greedy()
    reference = _plain_greedy(target, _prompts(), params)
    llm = LLM(model=target, block_size=4, max_num_seqs=8, **{"num_gpu_blocks": 64, **kw},
              speculative_config=_spec("eagle", head))
    try:
        steps0 = llm.engine.stats["steps"]
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)] == reference
        spec = llm.engine.get_stats()["spec_decode"]
        assert spec["num_accepted_tokens"] > 0.95 * spec["num_draft_tokens"], spec
        if "preemption_mode" in kw:
            assert sum(llm.engine.get_stats()["num_preemptions"].values()) > 0
        if not kw:
            assert llm.engine.stats["steps"] - steps0 < 12  # (24 tokens, K + 1 a step)
        assert not llm.engine.executor.worker.runner.drafter.pending
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_random_heads_change_no_greedy_token(tiny_llama_dir, heads, method) -> None:
    prompts = _prompts()
    reference = _plain_greedy(tiny_llama_dir, prompts, _greedy())
    llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
              speculative_config=_spec(method, heads[method]))
    try:
        # Sampled rows draw their guesses from the head's q and finish as asked.
        sampled = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8,
                                                       ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in sampled)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == reference
        assert llm.engine.get_stats()["spec_decode"]["num_drafts"] > 0
        drafter = llm.engine.executor.worker.runner.drafter
        assert not drafter.probs and not drafter.pending  # (the sampled ones' are gone)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def _edit(path: str, dest: Path, **fields) -> str:
    import shutil

    shutil.copytree(path, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(fields)
    (dest / "config.json").write_text(json.dumps(cfg))
    return str(dest)


def test_bad_heads_are_value_errors_naming_the_field(tmp_path, tiny_llama_dir, heads) -> None:
    cases = [
        (_spec("eagle", _edit(heads["eagle"], tmp_path / "v", vocab_size=1000)),
         "vocab_size"),
        (_spec("eagle", _edit(heads["eagle"], tmp_path / "h", hidden_size=32)),
         "hidden_size"),
        (_spec("eagle3", _edit(heads["eagle3"], tmp_path / "a",
                               eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]})),
         "three of the target's 2 layers"),
        (_spec("eagle3", _edit(heads["eagle3"], tmp_path / "d", eagle_config={})),
         "three of the target's 2 layers"),  # the default (2, L/2, L-3) needs 4+ layers
        (_spec("eagle", str(tmp_path / "missing")), "speculative_config.model"),
        (_spec("eagle", heads["eagle"], quantization="int8"), "speculative_config.quantization"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.model"),
    ]
    for spec, words in cases:
        with pytest.raises(ValueError, match=words):
            LLM(model=tiny_llama_dir, num_gpu_blocks=16, speculative_config=spec)
    # A head written for another target fails at load, naming what does not fit.
    with pytest.raises(ValueError, match=r"fc\.weight|checkpoint shape"):
        LLM(model=tiny_llama_dir, num_gpu_blocks=16, speculative_config=_spec(
            "eagle3", _edit(heads["eagle"], tmp_path / "e1", eagle_config={
                "eagle_aux_hidden_state_layer_ids": AUX})))


def test_shipped_prompt_kv_carries_the_heads_kv(tiny_llama_dir, heads) -> None:
    """Disaggregated prefill: the head's K/V travel beside the target's, and the decode
    engine's guesses after the imported prefix are still the dense reference's."""
    from pagedserve.cluster.kv_transfer import import_prompt_kv
    from tests.cluster.test_kv_transfer import prefill

    prompt = list(range(600, 623))
    spec = _spec("eagle3", heads["eagle3"])
    pre, dec = (LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
                    speculative_config=spec) for _ in range(2))
    try:
        payload = prefill(pre, [prompt])[0]
        assert all(len(s) == 4 for s in payload.shards)  # K, V, the head's K, V
        assert import_prompt_kv(dec.engine, payload) > 0
        seen = _record(dec)
        out = dec.generate([prompt], _greedy(6))[0]
        assert out.num_cached_tokens >= 20
        for llm in (pre, dec):
            assert_pool_at_baseline(llm)
    finally:
        pre.shutdown()
        dec.shutdown()
    dense = DenseHead(heads["eagle3"], tiny_llama_dir, "eagle3")
    full = prompt + out.outputs[0].token_ids
    assert seen
    for _, length, guesses in seen:
        assert guesses == dense.propose(tiny_llama_dir, full[:length], K, AUX), length


def test_sleep_and_new_weights_keep_the_head_attached(tiny_llama_dir, heads, tmp_path) -> None:
    """A model rebuilt after sleep level 2, or with new weights, keeps the layer inputs
    EAGLE-3 reads and lends the head its embedding anew."""
    from pagedserve.worker.testing import write_random_checkpoint

    prompts = _prompts()
    other = write_random_checkpoint(tmp_path / "other", "llama", tiny_llama_dir, seed=77)
    reference = _plain_greedy(other, prompts, _greedy())
    llm = LLM(model=tiny_llama_dir, block_size=4, num_gpu_blocks=64,
              speculative_config=_spec("eagle3", heads["eagle3"]))
    try:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
        llm.sleep(level=2)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == before
        llm.update_weights(other)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == reference
        worker = llm.engine.executor.worker
        assert worker.draft.model.embed_tokens is worker.model.embed_tokens
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
