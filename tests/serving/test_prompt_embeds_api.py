"""``prompt_embeds`` over HTTP (``/v1/completions``, vLLM's form): the default model's
own embedding rows of a text answer what the text does, through OpenAI's client too;
bad tensors are 400s naming the field, and leave nothing behind."""

from __future__ import annotations

import glob

import httpx
import pytest
import torch

from pagedserve.cluster.embeds_api import decoded_embeds
from pagedserve.cluster.prompt_embeds import encode_embeds
from pagedserve.cluster.protocol import APIError, CompletionRequest
from tests.serving.conftest import App

TEXTS = ["The capital of France is", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def table() -> torch.Tensor:
    """SmolLM2's token embedding matrix, read from the served checkpoint."""
    from safetensors import safe_open

    from pagedserve.worker.loaders import resolve_model

    path = glob.glob(f"{resolve_model(None).path}/*.safetensors")[0]
    with safe_open(path, "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def complete(app: App, **body: object) -> httpx.Response:
    return httpx.post(f"{app.base}/v1/completions", headers=app.headers, timeout=120,
                      json={"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
                            "temperature": 0.0, **body})


def test_embeds_answer_as_their_text_does(smol: App, table: torch.Tensor) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None).path)
    ids = [tok.encode(t) for t in TEXTS]
    by_text = complete(smol, prompt=TEXTS)
    assert by_text.status_code == 200, by_text.text
    want = sorted(by_text.json()["choices"], key=lambda c: c["index"])
    # Embeds come first, then the prompts; an empty prompt beside them is none (what
    # OpenAI's client must send).
    r = complete(smol, prompt_embeds=[encode_embeds(table[i]) for i in ids], prompt=TEXTS[:1])
    assert r.status_code == 200, r.text
    got = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got] == [c["text"] for c in want] + [want[0]["text"]]
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, ids)) + len(ids[0])
    with_ids = complete(smol, prompt_embeds=encode_embeds(table[ids[0]]), return_token_ids=True)
    choice = with_ids.json()["choices"][0]  # embeddings have no prompt ids to return
    assert choice["prompt_token_ids"] is None and len(choice["token_ids"]) == 8
    client = smol.openai()
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="", max_tokens=8,
                                    temperature=0.0,
                                    extra_body={"prompt_embeds": encode_embeds(table[ids[1]])})
    assert out.choices[0].text == want[1]["text"]
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="", max_tokens=8, temperature=0.0,
        stream=True, extra_body={"prompt_embeds": encode_embeds(table[ids[0]].half())})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text  # fp16 rows: the same prompt up to rounding, so only that it streams


@pytest.mark.parametrize("body,param,match", [
    ({"prompt_embeds": "%%%"}, "prompt_embeds", "base64"),
    ({"prompt_embeds": "aGVsbG8="}, "prompt_embeds", "torch.save"),
    ({"prompt_embeds": encode_embeds(torch.zeros(3, 32))}, "prompt_embeds",
     "hidden size 32, the model's is 576"),
    ({"prompt_embeds": encode_embeds(torch.zeros(3, 576, dtype=torch.int32))},
     "prompt_embeds", "float32"),
    ({"prompt_embeds": encode_embeds(torch.zeros(2000, 576))}, "prompt_embeds",
     "2000 tokens"),
    ({"prompt_embeds": encode_embeds(torch.zeros(3, 576)), "echo": True}, "echo", "echo"),
    ({"prompt_embeds": encode_embeds(torch.zeros(3, 576)), "prompt_logprobs": 1},
     "prompt_logprobs", "no tokens"),
    ({"prompt_embeds": []}, "prompt_embeds", "empty"),
    ({}, "prompt", "either prompt or prompt_embeds"),
])
def test_bad_embeds_are_400s_naming_the_field(smol: App, body: dict, param: str,
                                              match: str) -> None:
    r = complete(smol, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


def test_a_server_without_the_flag_refuses_them() -> None:
    body = CompletionRequest(model="m", prompt_embeds=encode_embeds(torch.zeros(2, 8)))
    with pytest.raises(APIError, match="--enable-prompt-embeds") as e:
        decoded_embeds(body, {"prompt_embeds": False, "hidden_size": 8})
    assert e.value.param == "prompt_embeds" and e.value.status == 400
    assert decoded_embeds(CompletionRequest(model="m", prompt="hi"), {}) == []
