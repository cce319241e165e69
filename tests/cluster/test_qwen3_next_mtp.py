"""Qwen3-Next's own multi-token-prediction module drafting for it
(``speculative_config={"method": "qwen3_next_mtp"}``, ``models.qwen3_next_mtp``).

Transformers never reads the module (no oracle for its guesses), so: a checkpoint
built so that the module computes the target's next token exactly
(``testing_qwen3_next_mtp.write_guessing_qwen3_next_mtp_model``) has every guess kept
and fewer steps, which fails if the module's wiring (the order of its two inputs,
its norms, the token it reads, the feature fed back) is wrong, and again after
sleep level 2 reloads it; a random module's guesses, mostly rejected, change no
greedy token (whole, in prefill chunks, under swap preemption, and in Qwen3.5's
dense and MoE files); a file without the module, or another hybrid, is refused by
name.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.testing import write_random_checkpoint
from pagedserve.worker.testing_qwen3_next_mtp import (
    add_random_qwen3_next_mtp,
    write_guessing_qwen3_next_mtp_model,
)
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _plain(path: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4)
    try:
        return _tokens(llm.generate(prompts, GREEDY))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory, default_model_dir) -> str:
    path = write_random_checkpoint(tmp_path_factory.mktemp("qwen3_next_mtp"), "qwen3_next",
                                   default_model_dir)
    return add_random_qwen3_next_mtp(path)


def test_a_module_that_knows_the_next_token_has_every_guess_kept(tmp_path,
                                                                  default_model_dir) -> None:
    path = write_guessing_qwen3_next_mtp_model(tmp_path / "guessing", default_model_dir)
    prompts = prompts_of_mixed_lengths(5)
    want = _plain(path, prompts)
    for method, k in (("qwen3_next_mtp", 2), ("mtp", 1)):
        llm = LLM(model=path, num_gpu_blocks=128, block_size=4,
                  speculative_config={"method": method, "num_speculative_tokens": k})
        try:
            steps0 = llm.engine.stats["steps"]
            assert _tokens(llm.generate(prompts, GREEDY)) == want
            s = llm.engine.get_stats()["spec_decode"]
            assert s["num_draft_tokens"] > 0, s
            assert s["num_accepted_tokens"] >= 0.95 * s["num_draft_tokens"], s
            # 16 tokens a row take 16 steps without guesses, ~16 / (k + 1) with them.
            assert llm.engine.stats["steps"] - steps0 <= 16 // (k + 1) + 3
            if method == "mtp":  # sleep level 2 drops the module with the model
                llm.sleep(2)
                assert llm.engine.executor.worker.draft is None
                llm.wake_up()
                before = llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"]
                assert _tokens(llm.generate(prompts, GREEDY)) == want
                after = llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"]
                assert after - before >= 0.95 * s["num_accepted_tokens"]
        finally:
            llm.shutdown()


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8},
                                {"num_gpu_blocks": 26, "preemption_mode": "swap"}])
def test_a_random_modules_guesses_change_no_token(random_mtp, kw) -> None:
    prompts = prompts_of_mixed_lengths(5)
    want = _plain(random_mtp, prompts)
    llm = LLM(model=random_mtp, block_size=4, **{"num_gpu_blocks": 128, **kw},
              speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == want
        assert llm.engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0
        if "preemption_mode" in kw:
            assert llm.engine.scheduler.num_preemptions["swap"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_files_draft_with_their_module(kind, tmp_path, default_model_dir) -> None:
    """Multimodal files: the decoder under ``model.language_model.``, the module at
    the top level (``mtp.``)."""
    path = add_random_qwen3_next_mtp(write_random_checkpoint(tmp_path / kind, kind,
                                                             default_model_dir))
    prompts = prompts_of_mixed_lengths(4)
    want = _plain(path, prompts)
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == want
        assert llm.engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0
    finally:
        llm.shutdown()


def test_what_has_no_module_is_refused_by_name(random_mtp, tmp_path,
                                               default_model_dir) -> None:
    spec = {"method": "qwen3_next_mtp"}
    bare = write_random_checkpoint(tmp_path / "bare", "qwen3_next", default_model_dir)
    with pytest.raises(ValueError, match=r"no MTP module \(mtp\.fc\.weight is missing\)"):
        LLM(model=bare, num_gpu_blocks=32, speculative_config=spec)
    granite = write_random_checkpoint(tmp_path / "granite", "granitemoehybrid",
                                      default_model_dir)
    with pytest.raises(ValueError, match="'granitemoehybrid' has no multi-token-prediction"):
        LLM(model=granite, num_gpu_blocks=32, speculative_config=spec)
    odd = shutil.copytree(random_mtp, tmp_path / "odd")
    tensors = load_file(f"{odd}/model.safetensors")
    del tensors["mtp.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, f"{odd}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"MTP module is missing .*self_attn\.k_norm"):
        LLM(model=str(odd), num_gpu_blocks=32, speculative_config=spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_module_on_cuda(tmp_path) -> None:
    """The module's gated attention through Triton over its own pool, the next-token
    module keeping every guess, on CUDA."""
    path = write_guessing_qwen3_next_mtp_model(tmp_path / "guessing")
    prompts = prompts_of_mixed_lengths(5)
    kw = dict(model=path, device="cuda", dtype="float32", num_gpu_blocks=256, block_size=16,
              attention_backend="triton")
    plain = LLM(**kw)
    try:
        want = _tokens(plain.generate(prompts, GREEDY))
    finally:
        plain.shutdown()
    llm = LLM(**kw, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == want
        s = llm.engine.get_stats()["spec_decode"]
        assert s["num_accepted_tokens"] >= 0.95 * s["num_draft_tokens"] > 0, s
    finally:
        llm.shutdown()
