"""``use_beam_search`` over HTTP (vLLM's extra parameter) with the OpenAI client.

Completions and chat completions with ``use_beam_search`` return the same
beams as the offline ``LLM.beam_search`` (``n`` of them per prompt, best
first), streamed or not, usage counts every beam's tokens, and the options
beam search cannot honour are 400s naming the field; the replica's pool is
back at baseline.
"""

from __future__ import annotations

import httpx
import pytest

from pagedserve.cluster import LLM, BeamSearchParams

PROMPTS = ["The three primary colours are", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline() -> dict[str, list[list[str]]]:
    llm = LLM(num_gpu_blocks=64)
    try:
        tok = llm.get_tokenizer()

        def texts(prompt: list[int], width: int, max_tokens: int) -> list[str]:
            out = llm.beam_search({"prompt_token_ids": prompt},
                                  BeamSearchParams(beam_width=width, max_tokens=max_tokens))[0]
            return [tok.decode(s.completion_token_ids, skip_special_tokens=True)
                    for s in out.sequences]

        chat = list(tok.apply_chat_template(QUESTION, add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
        return {"completions": [texts(tok.encode(p), 3, 12) for p in PROMPTS],
                "chat": [texts(chat, 2, 24)]}
    finally:
        llm.shutdown()


def test_completions_equal_the_offline_beams(smol, offline) -> None:
    client = smol.openai()
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, n=3,
                                  extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == offline["completions"][0] + offline["completions"][1]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    assert r.usage.completion_tokens <= 6 * 12 and r.usage.prompt_tokens > 0
    smol.wait_baseline()


def test_chat_beam_search_answers(smol, offline) -> None:
    client = smol.openai()
    r = client.chat.completions.create(model=client.models.list().data[0].id,
                                       messages=QUESTION, max_tokens=24, n=2,
                                       extra_body={"use_beam_search": True})
    assert [c.message.content for c in r.choices] == offline["chat"][0]
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    smol.wait_baseline()


def test_streamed_beams_arrive_whole(smol, offline) -> None:
    client = smol.openai()
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=12, n=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"use_beam_search": True}))
    texts = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert [texts[i] for i in range(6)] == offline["completions"][0] + offline["completions"][1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6 * 12
    chat = list(client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, n=2, stream=True,
        extra_body={"use_beam_search": True}))
    assert [c.choices[0].delta.content for c in chat] == offline["chat"][0]
    assert chat[0].choices[0].finish_reason == "stop"
    smol.wait_baseline()


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 11}, "n"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"stop": ["x"]}, "stop"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
    ("chat/completions", {"logprobs": True}, "logprobs"),
    ("chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]}, "tools"),
])
def test_what_beam_search_cannot_honour_is_a_400(smol, route: str, extra: dict,
                                                  param: str) -> None:
    body = {"use_beam_search": True, "max_tokens": 4, "n": 2, **extra}
    if route == "completions":
        body["prompt"] = PROMPTS[0]
    else:
        body["messages"] = QUESTION
    r = httpx.post(f"{smol.base}/v1/{route}", headers=smol.headers, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    smol.wait_baseline()
