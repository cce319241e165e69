"""vLLM's ``prompt_logprobs`` over HTTP on the default model: each prompt token's
logprob and rank among the whole vocabulary equal Hugging Face's on the same
weights, in vLLM's shape (per choice in completions, once in chat), alongside an
``echo`` that asked for fewer alternatives; streams and bad values are 400s."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.serving.conftest import App
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


def test_completion_prompt_logprobs_equal_hugging_face(smol: App) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

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
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

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
