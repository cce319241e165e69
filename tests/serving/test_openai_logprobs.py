"""Logprobs over HTTP on the default model: sampled tokens' (OpenAI's shapes, vLLM's
``return_tokens_as_token_ids``), an echoed prompt's (lm-eval-harness's request), and
vLLM's ``prompt_logprobs``: each prompt token's logprob and rank among the whole
vocabulary equal Hugging Face's on the same weights, in vLLM's shape (per choice in
completions, once in chat), alongside an ``echo`` that asked for fewer
alternatives; streams and bad values are 400s."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pagedserve.worker.loaders import load_tokenizer, resolve_model
from tests.serving.conftest import SMOL_ARGS, App
from tests.serving.test_openai_api import FRANCE, MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _post(app: App, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{app.base}/v1/{path}", json={"model": MODEL, **body},
                      headers=app.headers, timeout=120)


def _hf_logprobs(ids: list[int]) -> Any:
    """HF's log-softmax at each position of ``ids`` (row p predicts token p + 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.worker.loaders import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(None).path,
                                                 dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _check_against_hf(entries: list[dict[str, Any] | None], ids: list[int], k: int) -> None:
    ref = _hf_logprobs(ids)
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry = entries[pos]
        assert entry is not None
        first, *tops = entry.items()
        assert first[0] == str(ids[pos])  # the prompt token leads, as in vLLM
        row, target = ref[pos - 1], ref[pos - 1, ids[pos]]
        lo, hi = (int((row > target + d).sum()) + 1 for d in (1e-4, -1e-4))
        assert lo <= first[1]["rank"] <= hi
        top = row.topk(k).indices.tolist()
        assert {int(t) for t in entry} == set(top) | {ids[pos]}
        for tid, v in entry.items():
            assert v["logprob"] == pytest.approx(row[int(tid)].item(), abs=2e-4)
            assert isinstance(v["decoded_token"], str)
        # The k likeliest rank 1..k, the prompt token among them or after them.
        ranks = [v["rank"] for _, v in tops]
        if first[1]["rank"] <= k:
            assert sorted([first[1]["rank"], *ranks]) == list(range(1, k + 1))
        else:
            assert ranks == list(range(1, k + 1))


def test_logprobs(smol: App) -> None:
    client = smol.openai()
    r = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0,
                                  max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and tok_lp <= 0.0
        assert tok_lp == pytest.approx(max(top.values()))  # greedy takes the top token
    assert lp.text_offset[0] == 0
    c = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                       max_tokens=8, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    # The EOS token is sampled and counted too; its text is the special token itself.
    assert "".join(t.token for t in content) == c.choices[0].message.content + "<|im_end|>"
    assert c.usage.completion_tokens == len(content)
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # vLLM's return_tokens_as_token_ids: the same entries, tokens named by id.
    tok = load_tokenizer(resolve_model(None))
    ids = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                         max_tokens=8, logprobs=True, top_logprobs=3,
                                         extra_body={"return_tokens_as_token_ids": True})
    named = ids.choices[0].logprobs.content
    assert [t.logprob for t in named] == [t.logprob for t in content]
    assert [tok.decode([int(t.token.removeprefix("token_id:"))]) for t in named] == \
        [t.token for t in content]
    r2 = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0,
                                   max_tokens=6, logprobs=2,
                                   extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in r2.choices[0].logprobs.tokens)
    assert r2.choices[0].logprobs.text_offset == lp.text_offset


def test_completion_echo_leads_with_the_prompt_and_its_logprobs(smol: App) -> None:
    """lm-eval-harness's log-likelihood request: echo, logprobs=1, one new token; and
    the same echo streamed."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    r = smol.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                         temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    path = resolve_model(SMOL_ARGS.get("model")).path
    ids = load_tokenizer(path).encode(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and r.usage.prompt_tokens == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] >= len(prompt) - 1
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)
        assert 1 <= len(lp.top_logprobs[pos]) <= 2  # the top token, and the prompt's own
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-3)
    plain = smol.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                             temperature=0)
    assert c.text == prompt + plain.choices[0].text
    events = list(smol.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True,
        stream=True))
    first = events[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:len(ids)] == lp.token_logprobs[1:len(ids)]
    streamed = "".join(e.choices[0].text for e in events if e.choices)
    whole = smol.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                             temperature=0, echo=True)
    assert streamed == whole.choices[0].text and streamed.startswith(prompt)
    smol.wait_baseline()


def test_completion_prompt_logprobs_equal_hugging_face(smol: App) -> None:
    tok = load_tokenizer(resolve_model(None))
    prompts = ["The capital of France is", "def fibonacci(n):\n    return"]
    r = _post(smol, "completions", {"prompt": prompts, "max_tokens": 2, "n": 2,
                                    "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for k, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        a, b = choices[2 * k]["prompt_logprobs"], choices[2 * k + 1]["prompt_logprobs"]
        assert a == b  # every sample of a prompt carries its prompt's
        _check_against_hf(a, ids, 2)
    # With echo asking for one alternative: the echo keeps one, prompt_logprobs three.
    r = _post(smol, "completions", {"prompt": prompts[0], "max_tokens": 1, "echo": True,
                                    "logprobs": 1, "prompt_logprobs": 3, "temperature": 0})
    choice = r.json()["choices"][0]
    echo_tops = choice["logprobs"]["top_logprobs"][1:len(tok.encode(prompts[0]))]
    assert all(len(t) <= 2 for t in echo_tops)  # the top one, and the prompt token
    assert all(len(e) >= 3 for e in choice["prompt_logprobs"][1:])
    plain = _post(smol, "completions", {"prompt": prompts[0], "max_tokens": 1})
    assert "prompt_logprobs" not in plain.json()["choices"][0]


def test_chat_prompt_logprobs_cover_the_templated_prompt(smol: App) -> None:
    r = _post(smol, "chat/completions", {"messages": FRANCE, "max_tokens": 8,
                                         "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    tok = load_tokenizer(resolve_model(None))
    ids = list(tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] == len(ids)
    for pos, entry in enumerate(body["prompt_logprobs"][1:], 1):
        assert list(entry) == [str(ids[pos])]  # k = 0: the prompt token alone


@pytest.mark.parametrize(("path", "body"), [
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "use_beam_search": True, "n": 2}),
    ("chat/completions", {"messages": FRANCE, "prompt_logprobs": -1}),
    ("chat/completions", {"messages": FRANCE, "prompt_logprobs": 1, "stream": True}),
])
def test_bad_prompt_logprobs_are_400s(smol: App, path: str, body: dict[str, Any]) -> None:
    r = _post(smol, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"
