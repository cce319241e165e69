"""DeepSeek-V3's multi-token-prediction layer drafting for its own model
(``speculative_config={"method": "deepseek_mtp"}``) through the real engine.

Every guess equals a dense drafter built from Hugging Face's target and its own
decoder layer (``mtp_reference``), through whole and chunked prompts, prefix hits and
``n > 1`` siblings: the features, the shift by one token and the layer's latent KV
line up. Greedy output equals decoding without it, under preemption too; the pool
returns to its baseline; a target without the layer is refused, naming the method.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM
from pagedserve.worker.testing import write_random_checkpoint
from pagedserve.worker.testing_mtp import add_random_mtp_layer
from tests.cluster.mtp_reference import DenseMTP
from tests.cluster.test_eagle import _greedy, guesses_of_three_runs
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    path = write_random_checkpoint(tmp_path_factory.mktemp("v3_mtp"), "deepseek_v3",
                                   default_model_dir, num_key_value_heads=4,
                                   num_hidden_layers=2, max_position_embeddings=256)
    return add_random_mtp_layer(path, seed=5)


def _spec(k: int) -> dict:
    return {"method": "deepseek_mtp", "num_speculative_tokens": k}


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}], ids=["whole", "chunked"])
def test_every_guess_equals_the_dense_reference(mtp_dir, kw) -> None:
    seen = guesses_of_three_runs(LLM(model=mtp_dir, block_size=4, num_gpu_blocks=64, **kw,
                                     speculative_config=_spec(2)))
    dense = DenseMTP(mtp_dir)
    assert len(seen) >= 8
    for seq, length, guesses in seen:
        assert guesses == dense.propose(seq[:length], 2), length


def test_the_heads_logits_and_features_equal_the_dense_reference(mtp_dir) -> None:
    """One catch-up through the engine's head on HF's features: its logits and the
    feature it feeds back equal the dense layer's to 1e-4 (argmax guesses alone would
    not see a small departure, such as position 0's embedding left in)."""
    ids = list(range(500, 521))
    dense = DenseMTP(mtp_dir)
    with torch.inference_mode():
        hidden = dense.target.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
    llm = LLM(model=mtp_dir, block_size=4, num_gpu_blocks=64, speculative_config=_spec(1))
    try:
        runner = llm.engine.executor.worker.runner.drafter
        with torch.inference_mode():  # (a fresh pool: blocks 0-4 hold nothing)
            logits, fed = runner._run([(ids[1:], 0, list(range(5)))], hidden, [0], None)
    finally:
        llm.shutdown()
    out = dense._run(ids[1:], hidden)[-1]
    ref = dense._rms(out, "shared_head.norm.weight") @ dense.w["shared_head.head.weight"].T
    torch.testing.assert_close(fed[0], out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,kw", [(1, {}), (3, dict(num_gpu_blocks=20, preemption_mode="swap",
                                                    num_cpu_blocks=64))],
                         ids=["one_guess", "three_guesses_swapped"])
def test_greedy_output_equals_decoding_without_drafts(mtp_dir, k, kw) -> None:
    prompts = [list(range(300 + 11 * i, 300 + 11 * i + 3 + 7 * i)) for i in range(5)]
    params = _greedy(16)
    plain = LLM(model=mtp_dir, block_size=4, num_gpu_blocks=128)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()
    llm = LLM(model=mtp_dir, block_size=4, **{"num_gpu_blocks": 128, **kw},
              speculative_config=_spec(k))
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.get_stats()["spec_decode"]
        assert stats["num_draft_tokens"] > 0
        if kw:
            assert llm.engine.scheduler.num_preemptions["swap"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_target_without_the_layer_is_refused(tmp_path, default_model_dir) -> None:
    v3 = write_random_checkpoint(tmp_path / "v3", "deepseek_v3", default_model_dir,
                                 num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"deepseek_mtp.*no MTP layer"):
        LLM(model=v3, num_gpu_blocks=16, speculative_config=_spec(1))
    v2 = write_random_checkpoint(tmp_path / "v2", "deepseek_v2", default_model_dir,
                                 num_key_value_heads=4)
    with pytest.raises(ValueError, match="no multi-token-prediction module"):
        LLM(model=v2, num_gpu_blocks=16, speculative_config=_spec(1))
    with pytest.raises(ValueError, match="target's own layers"):
        LLM(model=str(Path(v3)), num_gpu_blocks=16,
            speculative_config={**_spec(1), "model": v3})


def test_new_weights_bring_their_own_mtp_layer(mtp_dir, tmp_path, default_model_dir) -> None:
    """``update_weights`` loads the new checkpoint's MTP layer as the drafter (awake, and
    asleep at level 2, which drops the head with the model and loads it on waking):
    every guess is then the new file's dense drafter's. A file without the layer is
    refused before anything changes, the old head still drafting."""
    other = add_random_mtp_layer(write_random_checkpoint(
        tmp_path / "b", "deepseek_v3", default_model_dir, seed=77, num_key_value_heads=4,
        num_hidden_layers=2, max_position_embeddings=256), seed=8)
    bare = write_random_checkpoint(tmp_path / "bare", "deepseek_v3", default_model_dir,
                                   seed=78, num_key_value_heads=4, num_hidden_layers=2,
                                   max_position_embeddings=256)
    for asleep in (False, True):
        llm = LLM(model=mtp_dir, block_size=4, num_gpu_blocks=64, speculative_config=_spec(2))
        if asleep:
            llm.sleep(2)
            assert llm.engine.executor.worker.draft is None  # dropped with the model
        with pytest.raises(ValueError, match=r"deepseek_mtp.*the new weights.*no MTP layer"):
            llm.update_weights(bare)
        llm.update_weights(other)
        if asleep:
            llm.wake_up()
        seen = guesses_of_three_runs(llm)
        dense = DenseMTP(other)
        assert len(seen) >= 8
        for seq, length, guesses in seen:
            assert guesses == dense.propose(seq[:length], 2), (asleep, length)
