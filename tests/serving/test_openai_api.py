"""The OpenAI-compatible API over HTTP with the official ``openai`` client, default model."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from pagedserve.worker.loaders import load_tokenizer, resolve_model
from tests.serving.conftest import API_KEY, SMOL_ARGS, App

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def hf_greedy_chat(messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """Hugging Face's greedy answer on the same converted weights and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.worker.loaders import resolve_model

    path = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_greedy_equals_hugging_face(smol: App) -> None:
    r = smol.openai().chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                              max_tokens=24)
    ours = r.choices[0].message.content
    assert ours == hf_greedy_chat(FRANCE, 24)
    assert ours == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.model == MODEL and r.object == "chat.completion"
    # Without a limit the answer runs to EOS (the default fits the context and the pool).
    r = smol.openai().chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    assert r.choices[0].message.content == ours


def test_streaming_equals_non_streaming_with_usage(smol: App) -> None:
    client = smol.openai()
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                          max_tokens=24)
    parts, usage, roles, finish = [], None, [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                                max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            roles.append(c.delta.role)
            finish = c.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert roles[0] == "assistant" and finish == "stop"
    assert usage is not None
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    prompt = "The three primary colours are"
    text = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=20, stream=True))
    assert streamed == text.choices[0].text and len(streamed) > 0


def test_usage_counts_and_cached_tokens(smol: App) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 8},
                {"role": "user", "content": "Name a colour."}]
    n_prompt = len(tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    client = smol.openai()
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=12, logprobs=True)
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=12, logprobs=True)
    for r in (first, second):
        assert r.usage.prompt_tokens == n_prompt
        assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
        assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    # The second request finds every full block of the prompt in the prefix cache.
    assert second.usage.prompt_tokens_details.cached_tokens == (n_prompt // 16) * 16
    assert second.choices[0].message.content == first.choices[0].message.content


def test_n3_shares_the_prompt_blocks(smol: App) -> None:
    from pagedserve.worker.loaders import load_tokenizer, resolve_model

    prompt = "Write a list of fruits. " * 12
    full = len(load_tokenizer(resolve_model(None)).encode(prompt)) // 16
    assert full >= 4
    stream = smol.openai().completions.create(model=MODEL, prompt=prompt, n=3, temperature=1.0,
                                              seed=7, max_tokens=48, stream=True,
                                              extra_body={"ignore_eos": True})
    texts = {0: "", 1: "", 2: ""}
    during = None
    for k, chunk in enumerate(stream):
        for c in chunk.choices:
            texts[c.index] += c.text
        if k == 12:
            (s,) = smol.stats().values()
            during = s["memory"]
    assert during is not None
    # The 3 samples hold the prompt's full blocks once (refcount 3) and pay only for
    # their own tails: a copy-on-write of the partial block and what they generated.
    assert during["num_shared_blocks"] >= full
    assert during["num_used_blocks"] <= full + 3 * 3
    assert all(texts.values()) and len(set(texts.values())) > 1
    smol.wait_baseline()


def test_stop_sequences(smol: App) -> None:
    client = smol.openai()
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                       max_tokens=24, stop=["Paris"])
    c = r.choices[0]
    assert c.message.content == "The capital of France is "
    assert c.finish_reason == "stop" and c.model_extra.get("stop_reason") == "Paris"
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                       max_tokens=24, stop="France",
                                       extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "The capital of France"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stop=["Paris"], stream=True)
        if ch.choices)
    assert streamed == "The capital of France is "


BAD: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", "{not json", None),
    ("/v1/chat/completions", {"messages": FRANCE, "request_id": ""}, "request_id"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model"),  # 404, as OpenAI's
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * (SMOL_ARGS["max_model_len"] + 10)}, None),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"10000000": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [10**7]},
     "stop_token_ids"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    # Reaches the replica, whose engine runs the fcfs policy.
    ("/v1/completions", {"prompt": "hi", "priority": 1}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "bad_words": "Paris"}, "bad_words"),
    ("/v1/chat/completions", {"messages": FRANCE, "bad_words": [" "]}, "bad_words"),
]


def test_bad_inputs_get_400_and_the_server_keeps_serving(smol: App) -> None:
    with httpx.Client(base_url=smol.base, headers=smol.headers, timeout=60) as http:
        for path, body, param in BAD:
            content = body if isinstance(body, str) else json.dumps(body)
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            unknown_model = isinstance(body, dict) and body.get("model") == "gpt-4"
            assert r.status_code == (404 if unknown_model else 400), (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
            assert set(err) == {"message", "type", "param", "code"}
            if param is not None:
                assert err["param"] == param, (body, err)
    with pytest.raises(openai.BadRequestError):
        smol.openai().completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    r = smol.openai().chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                              max_tokens=24)
    assert r.choices[0].message.content == "The capital of France is Paris."
    smol.wait_baseline()


def test_x_request_id_names_the_response_even_when_reused(smol: App) -> None:
    """Serve's front echoes ``X-Request-Id``; the response's id carries it (vLLM's
    ``chatcmpl-<id>``), streamed and not, and two requests sharing one both run."""
    import concurrent.futures

    def chat(stream: bool) -> tuple[httpx.Response, list[str]]:
        body = {"messages": FRANCE, "max_tokens": 8, "temperature": 0, "stream": stream}
        r = httpx.post(f"{smol.base}/v1/chat/completions", json=body, timeout=60,
                       headers={**smol.headers, "X-Request-Id": "trace-42"})
        ids = [json.loads(line[6:])["id"] for line in r.text.splitlines()
               if line.startswith("data: {")] if stream else [r.json()["id"]]
        return r, ids

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(chat, [False, True]))
    for r, ids in answers:
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        assert ids and set(ids) == {"chatcmpl-trace-42"}
    r = httpx.post(f"{smol.base}/v1/completions", headers=smol.headers, timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, "request_id": "mine"})
    assert r.json()["id"] == "cmpl-mine"
    smol.wait_baseline()


def test_penalties_and_logit_bias_are_honoured(smol: App) -> None:
    client = smol.openai()
    forced = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=4,
                                       temperature=0, logit_bias={"42": 100})
    tok = load_tokenizer(resolve_model(SMOL_ARGS.get("model")))
    assert forced.choices[0].text == tok.decode([42] * 4)
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                           max_tokens=24)
    penalised = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, frequency_penalty=2.0,
        presence_penalty=2.0, extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    banned = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                            max_tokens=24, extra_body={"bad_words": ["Paris"]})
    text = banned.choices[0].message.content
    assert "Paris" not in text and text.startswith("The capital of France is")
    # vLLM's allowed_token_ids and truncate_prompt_tokens (echo shows what the model saw).
    allowed = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=6,
                                        temperature=1.0, seed=3,
                                        extra_body={"allowed_token_ids": [42, 43]})
    pieces = "|".join(re.escape(tok.decode([t])) for t in (42, 43))
    assert re.fullmatch(f"(?:{pieces}){{6}}", allowed.choices[0].text)
    ids = tok.encode("one two three four five six seven")
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                    echo=True, extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text.startswith(tok.decode(ids[-3:]))
    smol.wait_baseline()


def test_structured_outputs_over_http(smol: App) -> None:
    """OpenAI's response_format json_schema, vLLM's guided_choice and guided_grammar,
    and a bad schema and grammar."""
    client = smol.openai()
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
              "required": ["city"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "stop"
    picked = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["Rome", "Paris"]})
    assert picked.choices[0].text in ("Rome", "Paris")
    yes_no = client.completions.create(
        model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=8, temperature=0,
        extra_body={"guided_grammar": 'root ::= (" yes" | " no") "."'})
    assert yes_no.choices[0].text in (" yes.", " no.")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"structured_outputs": {"grammar": "root ::="}})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": {"type": "no-such"}}})
    assert e.value.body["param"] == "response_format"
    smol.wait_baseline()


def test_api_key_is_required_on_the_api_only(smol: App) -> None:
    with pytest.raises(openai.AuthenticationError):
        App(smol.name, smol.base, api_key="wrong").openai().models.list()
    r = httpx.post(f"{smol.base}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = smol.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    one = smol.openai().models.retrieve(MODEL)  # GET /v1/models/{model}
    assert one.id == MODEL and one.model_dump() == models.data[0].model_dump() | {
        "created": one.created}
    with pytest.raises(openai.NotFoundError):
        smol.openai().models.retrieve("no-such-model")
    r = httpx.get(f"{smol.base}/v1/models/{MODEL}", timeout=30)
    assert r.status_code == 401
    assert smol.health().status_code == 200  # probes need no key
    assert API_KEY not in httpx.get(f"{smol.base}/metrics", timeout=30).text


def test_health_metrics_and_stats(smol: App) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    smol.openai().completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
    h = smol.health()
    assert h.status_code == 200 and h.json()["status"] == "ok"
    (rep,) = h.json()["replicas"]
    assert rep["result"]["ok"] is True
    text = httpx.get(f"{smol.base}/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("pagedserve_time_to_first_token_seconds", "pagedserve_e2e_request_latency_seconds",
                 "pagedserve_kv_blocks_used", "pagedserve_kv_blocks_free",
                 "pagedserve_num_requests_running", "pagedserve_num_requests_waiting",
                 "pagedserve_prefix_cache_hits", "pagedserve_generation_tokens",
                 "pagedserve_request_finished", "pagedserve_http_requests"):
        assert name in fams, name
    ttft_count = [s.value for s in fams["pagedserve_time_to_first_token_seconds"].samples
                  if s.name.endswith("_count")]
    assert ttft_count and ttft_count[0] >= 1
    gen = [s.value for s in fams["pagedserve_generation_tokens"].samples]
    assert gen and gen[0] > 0
    stats = smol.wait_baseline()
    (s,) = stats.values()
    assert s["memory"]["num_gpu_blocks"] == SMOL_ARGS["num_gpu_blocks"]
    assert s["finished_requests"] >= 1 and s["model"] == MODEL


def test_vllm_ping_load_and_version(smol: App) -> None:
    for method in ("GET", "POST"):  # SageMaker's health check
        r = httpx.request(method, f"{smol.base}/ping", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.get(f"{smol.base}/version", timeout=10).json()["version"]
    smol.wait_baseline()
    assert httpx.get(f"{smol.base}/load", timeout=30).json() == {"server_load": 0}
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{smol.base}/v1/chat/completions", json=body,
                      headers=smol.headers, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # generating now
        assert httpx.get(f"{smol.base}/load", timeout=30).json() == {"server_load": 1}
    smol.wait_baseline()


def test_batched_prompts_with_n_fan_out_concurrently(smol: App) -> None:
    """Several engine calls from one HTTP request: each gets its own replica assignment."""
    client = smol.openai()
    prompts = ["The sky is", "Two plus two is", "My favourite food is"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
               for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6,
                                  temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    for i, single in enumerate(singles):
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == single.choices[0].text
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    streamed = {i: "" for i in range(6)}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(6)] == [c.text for c in r.choices]
    smol.wait_baseline()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_over_http(smol: App, cluster, method: str) -> None:
    """A replica with n-gram or suffix guesses streams the same greedy text as a plain
    one, with its acceptance in /metrics (and the suffix cache's size), and ends at
    baseline; asked twice, the suffix replica guesses the second answer from the
    first."""
    from prometheus_client.parser import text_string_to_metric_families

    passage = ("The quick brown fox jumps over the lazy dog. Paged attention stores the key "
               "value cache in fixed size blocks so that memory waste stays below four "
               "percent, and the scheduler shares blocks between requests that have the "
               "same prefix.")
    msgs = [{"role": "user", "content": f"Repeat this text exactly:\n{passage}"}]
    if method == "suffix":  # an answer the prompt does not hold, asked twice
        msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    plain = smol.openai().chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                                  max_tokens=60).choices[0].message.content
    spec = {"method": "ngram", "num_speculative_tokens": 4} if method == "ngram" else {
        "method": "suffix", "suffix_decoding_max_cached_requests": 8}
    args = {**SMOL_ARGS, "api_key": None, "speculative_config": spec,
            "logits_processors": None}  # (not beside speculative decoding)
    app = cluster.deploy("spec", args)
    try:
        accepted = []
        for _ in range(1 if method == "ngram" else 2):
            parts = [c.choices[0].delta.content or "" for c in
                     app.openai().chat.completions.create(model=MODEL, messages=msgs,
                                                          temperature=0, max_tokens=60,
                                                          stream=True)
                     if c.choices]
            assert "".join(parts) == plain
            assert method == "suffix" or "lazy dog" in plain
            text = httpx.get(f"{app.base}/metrics", timeout=30).text
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            accepted.append(
                fams["pagedserve_spec_decode_num_accepted_tokens"].samples[0].value)
        assert accepted[0] > 10
        per_pos = {int(s.labels["position"]): s.value for s in
                   fams["pagedserve_spec_decode_num_accepted_tokens_per_pos"].samples}
        assert sum(per_pos.values()) == accepted[-1] and per_pos[0] >= per_pos[1] > 0
        if method == "suffix":  # the second answer came from the first: 52 of 59 kept
            assert accepted[1] - accepted[0] > max(40, 2 * accepted[0]), accepted
            cached = fams["pagedserve_spec_decode_suffix_cached_requests"].samples
            assert [s.value for s in cached] == [2.0]
        (s,) = app.wait_baseline().values()
        assert s["spec_decode"]["num_drafts"] > 0
    finally:
        cluster.delete("spec")
