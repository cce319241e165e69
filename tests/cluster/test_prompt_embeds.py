"""Prompts given as input embeddings (``prompt_embeds``) through the engine: Hugging
Face ``generate(inputs_embeds=...)`` is the oracle, the same prompt as token ids the
second one; prefix caching, chunking, preemption and refusals checked on their own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.prompt_embeds import EmbedsPrompt, decode_embeds, encode_embeds

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
IDS = [[(i * 37 + 11) % 4000 + 100 for i in range(29)],
       [(i * 53 + 7) % 4000 + 100 for i in range(16)],
       [(i * 19 + 3) % 4000 + 100 for i in range(5)]]


def hf_embeds(model_dir: str, ids_list: list[list[int]]) -> tuple[list[torch.Tensor], Any]:
    """Each prompt's input embeddings as Hugging Face's model computes them, and the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.get_input_embeddings()(torch.tensor(ids)) for ids in ids_list], model


def hf_generate_embeds(model: Any, embeds: torch.Tensor, max_new_tokens: int,
                       **kw: Any) -> list[int]:
    with torch.inference_mode():
        out = model.generate(inputs_embeds=embeds[None],
                             attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, pad_token_id=0, **kw)
    return out[0].tolist()  # (only the new tokens: there were no input ids)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: str) -> Iterator[LLM]:
    # A 20-token step budget over 16-token blocks: the long prompt is prefilled in
    # chunks that end inside a span.
    llm = LLM(tiny_llama_dir, enable_prompt_embeds=True, block_size=16, num_gpu_blocks=64,
              max_num_batched_tokens=20, max_model_len=128)
    yield llm
    llm.shutdown()


def test_embeds_generate_what_hf_and_the_token_prompt_do(llama: LLM,
                                                          tiny_llama_dir: str) -> None:
    embeds, model = hf_embeds(tiny_llama_dir, IDS)
    want = [hf_generate_embeds(model, e, 10) for e in embeds]
    got = llama.generate([{"prompt_embeds": e} for e in embeds], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    by_ids = llama.generate([{"prompt_token_ids": ids} for ids in IDS], GREEDY)
    assert [o.outputs[0].token_ids for o in by_ids] == want
    tok = llama.get_tokenizer()
    for o in got:  # one placeholder per row; the text starts from no prompt context
        assert len(o.prompt_token_ids) in {len(i) for i in IDS}
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    # A batch of one, bf16 rows and the base64 form are the same prompt.
    e = embeds[0]
    again = llama.generate([{"prompt_embeds": e[None]},
                            {"prompt_embeds": decode_embeds(encode_embeds(e))}], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [want[0], want[0]]
    assert llama.generate({"prompt_embeds": e.bfloat16()}, GREEDY)[0].outputs[0].token_ids


def test_repetition_penalty_sees_no_prompt_tokens(llama: LLM, tiny_llama_dir: str) -> None:
    """Hugging Face penalises the ids it has seen: with embeddings only the generated
    ones, so the placeholders must not count."""
    embeds, model = hf_embeds(tiny_llama_dir, IDS[:1])
    want = hf_generate_embeds(model, embeds[0], 10, repetition_penalty=1.8)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.8)
    assert llama.generate({"prompt_embeds": embeds[0]}, params)[0].outputs[0].token_ids == want


def test_embeds_that_begin_alike_share_cached_blocks(llama: LLM) -> None:
    torch.manual_seed(3)
    head = torch.randn(40, 64)
    first = llama.generate({"prompt_embeds": torch.cat([head, torch.randn(5, 64)])}, GREEDY)
    assert first[0].num_cached_tokens == 0
    second = llama.generate({"prompt_embeds": torch.cat([head, torch.randn(9, 64)])}, GREEDY)
    assert second[0].num_cached_tokens == 32  # the two whole blocks of the shared rows
    other = head.clone()
    other[20] += 1.0  # the second block differs: only the first is shared
    third = llama.generate({"prompt_embeds": torch.cat([other, torch.randn(3, 64)])}, GREEDY)
    assert third[0].num_cached_tokens == 16
    # Token prompts never hit embedding blocks, even of the same placeholder ids.
    assert llama.generate({"prompt_token_ids": [0] * 45}, GREEDY)[0].num_cached_tokens == 0


def test_sampling_forks_and_beam_search_run_on_embeds(llama: LLM,
                                                      tiny_llama_dir: str) -> None:
    from pagedserve.cluster import BeamSearchParams

    embeds, _ = hf_embeds(tiny_llama_dir, IDS[:1])
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3)
    a = llama.generate({"prompt_embeds": embeds[0]}, seeded)[0]
    b = llama.generate({"prompt_token_ids": IDS[0]}, seeded)[0]
    assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    by_embeds = llama.beam_search([{"prompt_embeds": embeds[0]}], beams)[0]
    by_ids = llama.beam_search([{"prompt_token_ids": IDS[0]}], beams)[0]
    assert [s.tokens[-6:] for s in by_embeds.sequences] == \
        [s.tokens[-6:] for s in by_ids.sequences]


def test_recompute_preemption_keeps_the_embeddings(tiny_llama_dir: str) -> None:
    """A pool too small for every request at once: preempted ones are prefilled again
    from their rows, and end as they do alone."""
    embeds, model = hf_embeds(tiny_llama_dir, IDS)
    want = [hf_generate_embeds(model, e, 24) for e in embeds]
    llm = LLM(tiny_llama_dir, enable_prompt_embeds=True, block_size=16, num_gpu_blocks=6,
              preemption_mode="recompute", max_model_len=96)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_embeds": e} for e in embeds], params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    finally:
        llm.shutdown()


def test_gemma_embeds_enter_after_its_scaling(tiny_gemma3_dir: str) -> None:
    """Gemma 3's input embeddings are scaled by sqrt(hidden) in its embedding layer
    (Hugging Face's and vLLM's): prompt embeddings are taken as that layer gives them."""
    embeds, model = hf_embeds(tiny_gemma3_dir, IDS[:2])
    want = [hf_generate_embeds(model, e, 8) for e in embeds]
    llm = LLM(tiny_gemma3_dir, enable_prompt_embeds=True, num_gpu_blocks=64)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        got = llm.generate([{"prompt_embeds": e} for e in embeds], params)
        assert [o.outputs[0].token_ids for o in got] == want
    finally:
        llm.shutdown()


def test_spans_ship_only_their_own_rows() -> None:
    """A span's rows are its own tensor: pickled into a plan for Ray ranks, each carries
    its block of rows, not the whole prompt's storage."""
    import pickle

    from pagedserve.cluster.prompt_embeds import embeds_inputs

    prompt = EmbedsPrompt(torch.randn(640, 64))
    ids, spans = embeds_inputs(prompt, 64, 16)
    assert ids == [0] * 640 and len(spans) == 40
    assert all(len(pickle.dumps(s.pixels)) < 2 * 16 * 64 * 4 for s in spans)
    assert len(pickle.dumps(prompt.truncated(16).embeds)) < 2 * 16 * 64 * 4


@pytest.mark.parametrize("value,match", [
    (torch.zeros(4), "2-D"),
    (torch.zeros(2, 4, 64), "2-D"),
    (torch.zeros(0, 64), "empty"),
    (torch.zeros(4, 64, dtype=torch.int64), "float32, float16 or bfloat16"),
    (torch.full((4, 64), float("nan")), "NaN"),
    (torch.zeros(4, 64).to_sparse(), "dense"),
    ([[0.0] * 64], "torch tensor"),
])
def test_bad_tensors_are_refused_by_field(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EmbedsPrompt(value)


def test_bad_base64_is_refused_by_field() -> None:
    with pytest.raises(ValueError, match="prompt_embeds must be a base64"):
        decode_embeds("not base64!")
    with pytest.raises(ValueError, match=r"not a torch\.save'd tensor"):
        decode_embeds("aGVsbG8=")
    with pytest.raises(ValueError, match="hidden size 32, the model's is 64"):
        decode_embeds(encode_embeds(torch.zeros(3, 32)), hidden_size=64)


def test_engine_refuses_what_embeds_cannot_take(llama: LLM, tiny_llama_dir: str) -> None:
    e = torch.randn(8, 64)
    with pytest.raises(ValueError, match="hidden size 32, the model's is 64"):
        llama.generate({"prompt_embeds": torch.randn(8, 32)}, GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llama.generate({"prompt_embeds": e}, SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(ValueError, match="no images"):
        llama.generate({"prompt_embeds": e, "multi_modal_data": {"image": [object()]}},
                       GREEDY)
    with pytest.raises(ValueError, match=r"prompt is 200 tokens, the model.s context is 128"):
        llama.generate({"prompt_embeds": torch.randn(200, 64)}, GREEDY)
    kept = SamplingParams(max_tokens=3, temperature=0.0, truncate_prompt_tokens=5)
    tail = llama.generate({"prompt_embeds": torch.cat([torch.randn(30, 64), e[:5]])}, kept)
    alone = llama.generate({"prompt_embeds": e[:5]}, kept)
    assert tail[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert len(tail[0].prompt_token_ids) == 5
    assert not llama.engine.has_unfinished_requests()
    plain = LLM(tiny_llama_dir, num_gpu_blocks=16)
    try:
        with pytest.raises(ValueError, match="--enable-prompt-embeds"):
            plain.generate({"prompt_embeds": e}, GREEDY)
    finally:
        plain.shutdown()


def test_draft_model_speculation_stays_exact(llama: LLM, tiny_llama_dir: str) -> None:
    """A draft model reads the placeholder ids of the prompt (its guesses then miss),
    but verification keeps the target's tokens."""
    embeds, _ = hf_embeds(tiny_llama_dir, IDS[:1])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = llama.generate({"prompt_embeds": embeds[0]}, params)[0].outputs[0].token_ids
    llm = LLM(tiny_llama_dir, enable_prompt_embeds=True, num_gpu_blocks=32,
              speculative_config={"model": tiny_llama_dir, "num_speculative_tokens": 3})
    try:
        got = llm.generate({"prompt_embeds": embeds[0]}, params)[0].outputs[0].token_ids
        assert got == want and llm.engine.scheduler.spec_stats["num_draft_tokens"] > 0
    finally:
        llm.shutdown()
