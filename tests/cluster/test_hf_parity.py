"""Greedy tokens equal Hugging Face ``generate`` on the same weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from tests.cluster.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts_of_mixed_lengths(n: int = 6) -> list[list[int]]:
    return [[(37 * i + 11 * j) % 4000 + 100 for j in range(3 + 9 * i)] for i in range(n)]


def test_default_model_chat_answer_equals_hugging_face(smol_llm, default_model_dir) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    out = smol_llm.chat(messages, params)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    tok = smol_llm.get_tokenizer()
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    ref = hf_greedy(default_model_dir, [ids], 20, ignore_eos=False)[0]
    assert out.outputs[0].token_ids == ref


def test_continue_final_message_goes_on_with_the_assistant_turn(smol_llm,
                                                                default_model_dir) -> None:
    """vLLM's ``continue_final_message``: the prompt ends inside the assistant's open
    message (no end-of-turn token), and the answer is its continuation, HF's tokens."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = smol_llm.chat(messages, params, add_generation_prompt=False,
                        continue_final_message=True)[0]
    tok = smol_llm.get_tokenizer()
    ids = list(tok.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                       return_dict=False))
    assert out.prompt_token_ids == ids
    assert tok.decode(ids).endswith("The capital of France is")  # no <|im_end|> after it
    assert out.outputs[0].token_ids == hf_greedy(default_model_dir, [ids], 8,
                                                 ignore_eos=False)[0]
    assert out.outputs[0].text.startswith(" Paris")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        smol_llm.chat(messages, params, continue_final_message=True)


def test_default_model_mixed_batch_equals_hugging_face(smol_llm, default_model_dir) -> None:
    prompts = ["The quick brown fox", "In 1492, Columbus",
               "def fibonacci(n):\n    ", "Paris is the capital of"]
    tok = smol_llm.get_tokenizer()
    ids = [tok.encode(p) for p in prompts]
    outs = smol_llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(default_model_dir, ids, 12)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_yarn_dir",
                                     "tiny_mixtral_dir", "tiny_qwen2_moe_dir",
                                     "tiny_qwen3_moe_dir", "tiny_gemma3_dir",
                                     "tiny_gemma2_dir", "tiny_phi3_dir",
                                     "tiny_gpt_oss_dir", "tiny_granite_dir",
                                     "tiny_granitemoe_dir"])
def test_random_checkpoint_batch_equals_hugging_face(fixture, request) -> None:
    path = request.getfixturevalue(fixture)
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(path, prompts, 12)
    llm = LLM(model=path, num_gpu_blocks=128)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        # The same prompts again: every full prompt block is a prefix-cache hit.
        hits_before = llm.engine.scheduler.kv.prefix_hits
        again = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == ref
        assert llm.engine.scheduler.kv.prefix_hits > hits_before
        assert max(o.num_cached_tokens for o in again) >= 16
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=8, max_num_seqs=4),
                                dict(long_prefill_token_threshold=7)],
                         ids=["budget", "per-prompt cap"])
def test_chunked_prefill_equals_hugging_face(tiny_llama_dir, kw: dict) -> None:
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(tiny_llama_dir, prompts, 12)
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=128, **kw)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        if "long_prefill_token_threshold" in kw:  # the cap reached the scheduler
            assert llm.engine.scheduler.config.long_prefill_token_threshold == 7
    finally:
        llm.shutdown()


class _OpenAIPenalties:
    """Frequency and presence penalties over the generated tokens, as a HF logits processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:],
                                    minlength=scores.shape[1])[: scores.shape[1]].float()
            scores[b] -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores


@pytest.mark.parametrize("setup", ["whole", "chunked", "preempted"])
def test_penalties_equal_hugging_face(tiny_llama_dir, setup: str) -> None:
    """Repetition (HF's own processor) with frequency and presence on top, through
    chunked prefill and recompute preemption, which re-send the history."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(tiny_llama_dir, prompts, 16, repetition_penalty=1.3,
                    processors=lambda n: [_OpenAIPenalties(n, 0.4, 0.6)])
    plain = hf_greedy(tiny_llama_dir, prompts, 16)
    assert ref != plain  # the penalties change the greedy tokens
    kw = {"whole": {}, "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
          "preempted": dict(num_gpu_blocks=12, preemption_mode="recompute",
                            max_num_batched_tokens=64)}[setup]
    llm = LLM(model=tiny_llama_dir, **{"num_gpu_blocks": 128, **kw})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                repetition_penalty=1.3, presence_penalty=0.4,
                                frequency_penalty=0.6)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        if setup == "preempted":
            assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    finally:
        llm.shutdown()


def test_out_of_vocabulary_token_settings_are_rejected(tiny_llama_dir) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=32)
    try:
        for field, params in [
            ("stop_token_ids", SamplingParams(min_tokens=1, stop_token_ids=[10**6])),
            ("logit_bias", SamplingParams(logit_bias={10**6: 1.0})),
        ]:
            with pytest.raises(ValueError, match=field):
                llm.generate([[5, 6, 7]], params)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, logit_bias={42: 100}))
        assert out[0].outputs[0].token_ids == [42, 42, 42]
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hugging_face(tiny_llama_dir, chunked: bool) -> None:
    from transformers import AutoModelForCausalLM

    prompts = prompts_of_mixed_lengths(4)[1:]  # 12, 21 and 30 tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    kw = dict(max_num_batched_tokens=8, max_num_seqs=4) if chunked else {}
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2)
        for _ in range(2):  # the second time the prompts' blocks are cached: still computed
            outs = llm.generate(prompts, params)
            for ids, out in zip(prompts, outs):
                with torch.inference_mode():
                    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
                lps = out.prompt_logprobs
                assert lps is not None and len(lps) == len(ids) and lps[0] is None
                for pos in range(1, len(ids)):
                    entry = lps[pos]
                    top = ref[pos - 1].topk(3)
                    assert set(entry) == set(top.indices.tolist()) | {ids[pos]}
                    for tok, lp in entry.items():
                        assert lp == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
                    # The token's rank among the whole vocabulary (1 = likeliest): HF's,
                    # up to tokens within float noise of it.
                    row, target = ref[pos - 1], ref[pos - 1, ids[pos]]
                    lo = int((row > target + 1e-4).sum()) + 1
                    hi = int((row > target - 1e-4).sum()) + 1
                    assert lo <= out.prompt_logprob_ranks[pos] <= hi
                assert out.prompt_logprob_ranks[0] is None
                assert max(out.prompt_logprob_ranks[1:]) > 3  # some lie beyond the top 3
        plain = llm.generate(prompts[:1], SamplingParams(max_tokens=1))[0]
        assert plain.prompt_logprobs is None and plain.prompt_logprob_ranks is None
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()
