"""Request models, engine deltas and response formatting, without Ray (milliseconds)."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from pagedserve.cluster.chat_protocol import ChatCompletionRequest
from pagedserve.cluster.metrics import RequestTimer, ServerMetrics, render_prometheus
from pagedserve.cluster.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.protocol import APIError, CompletionRequest, max_tokens_for
from pagedserve.cluster.request_ids import request_ids
from pagedserve.cluster.responses import Formatter, ResponseState
from pagedserve.cluster.tokenize_api import TokenizeRequest
from pagedserve.cluster.wire import DeltaTracker, EngineChunk


def test_completion_request_maps_to_sampling_params() -> None:
    req = CompletionRequest(prompt="hi", n=2, temperature=0.5, top_p=0.9, top_k=5, seed=3,
                            stop="END", max_tokens=7, logprobs=2, min_p=0.1)
    req.check()
    sp = req.sampling_params(req.max_tokens or 16, req.logprobs)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (2, 0.5, 0.9, 5, 3)
    assert sp.min_p == 0.1 and CompletionRequest(prompt="x").sampling_params(4, None).min_p == 0
    assert sp.skip_special_tokens
    raw = CompletionRequest(prompt="x", skip_special_tokens=False).sampling_params(4, None)
    assert raw.skip_special_tokens is False
    req = CompletionRequest(prompt="x", allowed_token_ids=[4, 9], truncate_prompt_tokens=3)
    extra = req.sampling_params(4, None)
    assert extra.allowed_token_ids == [4, 9] and extra.truncate_prompt_tokens == 3
    assert req.truncate([1, 2, 3, 4, 5]) == [3, 4, 5]
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", allowed_token_ids=[70]).sampling_params(4, None, 50)
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", truncate_prompt_tokens=-1).truncate([1, 2])
    assert e.value.param == "truncate_prompt_tokens"
    assert sp.stop == ["END"] and sp.max_tokens == 7 and sp.logprobs == 2
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
])
def test_bad_sampling_values_name_their_field(body: dict, param: str) -> None:
    req = CompletionRequest(**body)
    with pytest.raises(APIError) as e:
        req.sampling_params(16, None)
    assert e.value.param == param and e.value.status == 400


def test_penalties_and_logit_bias_reach_the_params() -> None:
    req = CompletionRequest(prompt="x", presence_penalty=0.5, frequency_penalty=-1.0,
                            repetition_penalty=1.2, logit_bias={"7": -100, "12": 2.5})
    p = req.sampling_params(16, None, vocab_size=50)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.logit_bias == {7: -100.0, 12: 2.5} and p.uses_penalties
    assert not CompletionRequest(prompt="x").sampling_params(16, None).uses_penalties
    for body, param in [({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"frequency_penalty": -3}, "frequency_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"logit_bias": {"seven": 1}}, "logit_bias"),
                        ({"logit_bias": {"7": 101}}, "logit_bias"),
                        ({"logit_bias": {"50": 1}}, "logit_bias"),
                        ({"stop_token_ids": [3, 50]}, "stop_token_ids")]:
        with pytest.raises(APIError) as e:
            CompletionRequest(prompt="x", **body).sampling_params(16, None, vocab_size=50)
        assert e.value.param == param and e.value.status == 400, body


def test_strict_types_and_unsupported_options() -> None:
    for bad in ({"prompt": "x", "max_tokens": "5"}, {"prompt": "x", "n": True},
                {"prompt": 5}, {"prompt": "x", "temperature": "hot"}):
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", suffix="!").check()
    assert e.value.param == "suffix"
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 max_completion_tokens=0)
    with pytest.raises(APIError) as e:
        chat.sampling_params(0, None)
    assert e.value.param == "max_completion_tokens"
    assert CompletionRequest(prompt="x", unknown_field=1).prompt == "x"  # ignored, as OpenAI


def _out(texts: list[str], ids: list[list[int]], finish: list[str | None],
         lps: list[list[dict[int, float]]] | None = None) -> RequestOutput:
    outs = [CompletionOutput(i, t, list(x), None if lps is None else sum(
        lp[tok] for lp, tok in zip(lps[i], x)), None if lps is None else lps[i], f)
        for i, (t, x, f) in enumerate(zip(texts, ids, finish))]
    return RequestOutput("r", None, [1, 2, 3], outs, all(finish), 2)


def test_token_limits_blame_the_field_that_does_not_fit() -> None:
    """A prompt at the context length is the prompt's fault (``prompt`` for a completion,
    ``messages`` for a chat); a limit past it is the limit's; no limit runs to the end of
    the context or of the KV pool shared by the ``n`` samples."""
    info = {"max_model_len": 100, "pool_tokens": 160}
    for prompt_param in ("prompt", "messages"):
        with pytest.raises(APIError) as e:
            max_tokens_for(5, 100, info, prompt_param=prompt_param)
        assert (e.value.param, e.value.code) == (prompt_param, "context_length_exceeded")
        with pytest.raises(APIError) as e:
            max_tokens_for(None, 90, {**info, "pool_tokens": 90}, prompt_param=prompt_param)
        assert e.value.param == prompt_param and "no room" in e.value.message
    with pytest.raises(APIError) as e:
        max_tokens_for(11, 90, info, "max_completion_tokens")
    assert (e.value.param, e.value.code) == ("max_completion_tokens", "context_length_exceeded")
    assert max_tokens_for(10, 90, info) == 10
    assert max_tokens_for(None, 40, info) == 60  # the context's end
    assert max_tokens_for(None, 40, info, n=4) == 30  # (160 - 40) // 4 of the pool


def test_continue_final_message_excludes_a_generation_prompt() -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for body in (ChatCompletionRequest(messages=msgs, continue_final_message=True),
                 TokenizeRequest(messages=msgs, continue_final_message=True)):
        with pytest.raises(APIError) as e:
            body.check()
        assert e.value.param == "continue_final_message"
    ChatCompletionRequest(messages=msgs, continue_final_message=True,
                          add_generation_prompt=False).check()
    TokenizeRequest(prompt="Hi", continue_final_message=True).check()  # no template: moot
    with pytest.raises(APIError) as e:  # not through the template variables either
        ChatCompletionRequest(messages=msgs, add_generation_prompt=False,
                              chat_template_kwargs={"continue_final_message": True}).check()
    assert e.value.param == "chat_template_kwargs"


def test_reasoning_effort_reaches_the_chat_template() -> None:
    """OpenAI's ``reasoning_effort`` is a template variable (GPT-OSS's template writes it
    into its system message), as in vLLM; an explicit ``chat_template_kwargs`` entry
    wins, a value outside low / medium / high is a 400, and the Responses API's
    ``reasoning.effort`` arrives the same way."""
    from pagedserve.cluster.responses_protocol import ResponsesRequest

    msgs = [{"role": "user", "content": "Hi"}]
    body = ChatCompletionRequest(messages=msgs, reasoning_effort="high")
    body.check()
    assert body.chat_template_kwargs == {"reasoning_effort": "high"}
    body = ChatCompletionRequest(messages=msgs, reasoning_effort="low",
                                 chat_template_kwargs={"reasoning_effort": "medium", "x": 1})
    body.check()
    assert body.chat_template_kwargs == {"reasoning_effort": "medium", "x": 1}
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=msgs, reasoning_effort="extreme")
    chat = ResponsesRequest(input="hi", reasoning={"effort": "low"}).to_chat()
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}
    assert ResponsesRequest(input="hi").to_chat().chat_template_kwargs is None
    with pytest.raises(APIError) as e:
        ResponsesRequest(input="hi", reasoning={"effort": "extreme"}).to_chat()
    assert e.value.param == "reasoning"


def test_delta_tracker_sends_each_token_once() -> None:
    tr = DeltaTracker(2)
    d1 = tr.deltas(_out(["a", ""], [[5], []], [None, None]))
    assert [(d.index, d.text, d.token_ids) for d in d1] == [(0, "a", [5])]
    d2 = tr.deltas(_out(["ab", "x"], [[5, 6], [9]], ["length", None]))
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in d2] == [
        (0, "b", [6], "length"), (1, "x", [9], None)]
    d3 = tr.deltas(_out(["ab", "xy"], [[5, 6], [9, 4]], ["length", "stop"]))
    assert [(d.index, d.text) for d in d3] == [(1, "y")]


def test_delta_tracker_reads_each_sampled_logprob_from_its_step_dict() -> None:
    """The engine's per-token dict always holds the sampled token, even outside the top-k."""
    tr = DeltaTracker(1)
    lp = [{7: -0.1}, {3: -0.5, 8: -2.0}]  # second sampled token (8) is not the top-1
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [7], -0.1, lp[:1])])
    assert tr.deltas(out)[0].sampled_logprobs == [-0.1]
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [7, 8], -2.1, lp)])
    assert tr.deltas(out)[0].sampled_logprobs == [-2.0]


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _chunks() -> list[EngineChunk]:
    tr = DeltaTracker(1)
    lps = [[{0: -0.1, 1: -2.0}, {1: -0.2, 0: -1.5}]]
    return [EngineChunk("r", "rep", prompt_tokens=3),
            EngineChunk("r", "rep", tr.deltas(_out(["a"], [[0]], [None], [lps[0][:1]])), 3, 2),
            EngineChunk("r", "rep", tr.deltas(_out(["ab"], [[0, 1]], ["stop"], lps)), 3, 2,
                        True)]


def test_formatter_full_and_streamed_responses_agree() -> None:
    fmt = Formatter(_Tok(), "m")
    for kind in ("text_completion", "chat.completion"):
        full = ResponseState(kind, "id1", [(3, 1)], logprobs=True)
        for c in _chunks():
            fmt.add(full, 0, c)
        body = fmt.full_response(full)
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        streamed = ResponseState(kind, "id2", [(3, 1)], logprobs=True)
        events = [e for c in _chunks() for e in fmt.stream_events(streamed, 0, c, False)]
        payloads = [json.loads(e[len("data: "):]) for e in events]
        if kind == "chat.completion":
            assert choice["message"]["content"] == "ab"
            assert [t["token"] for t in choice["logprobs"]["content"]] == ["a", "b"]
            assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(p["choices"][0]["delta"]["content"] for p in payloads)
        else:
            assert choice["text"] == "ab"
            assert choice["logprobs"]["tokens"] == ["a", "b"]
            assert choice["logprobs"]["text_offset"] == [0, 1]
            assert choice["logprobs"]["token_logprobs"] == [-0.1, -0.2]
            text = "".join(p["choices"][0]["text"] for p in payloads)
        assert text == "ab" and payloads[-1]["choices"][0]["finish_reason"] == "stop"
        usage = json.loads(fmt.usage_event(streamed)[len("data: "):])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


def test_chat_top_logprobs_has_exactly_the_requested_count() -> None:
    """The engine's per-token dict adds the sampled token when it is outside the top-N;
    chat ``top_logprobs`` still lists exactly N alternatives, and ``logprob`` is the sample's."""
    tr = DeltaTracker(1)
    lp = [{3: -0.1, 5: -2.5}]  # top-1 is token 3; token 5 was sampled
    chunk = EngineChunk("r", "rep", tr.deltas(_out(["f"], [[5]], ["length"], [lp])), 3, 0, True)
    fmt = Formatter(_Tok(), "m")
    st = ResponseState("chat.completion", "id", [(3, 1)], logprobs=True, top_n=1)
    fmt.add(st, 0, chunk)
    (entry,) = fmt.full_response(st)["choices"][0]["logprobs"]["content"]
    assert entry["logprob"] == -2.5
    assert [t["token"] for t in entry["top_logprobs"]] == ["d"]


def test_tokens_as_ids_name_logprob_tokens_by_id() -> None:
    """vLLM's ``return_tokens_as_token_ids``: every logprob entry names its token
    ``token_id:N``, streamed or not; the text and its offsets stay the decoded text."""
    fmt = Formatter(_Tok(), "m")
    for kind in ("text_completion", "chat.completion"):
        st = ResponseState(kind, "id", [(3, 1)], logprobs=True, tokens_as_ids=True)
        for c in _chunks():
            fmt.add(st, 0, c)
        choice = fmt.full_response(st)["choices"][0]
        streamed = ResponseState(kind, "id2", [(3, 1)], logprobs=True, tokens_as_ids=True)
        chunks = [p for c in _chunks() for p in fmt.stream_chunks(streamed, 0, c, False)]
        if kind == "chat.completion":
            entries = choice["logprobs"]["content"]
            assert [e["token"] for e in entries] == ["token_id:0", "token_id:1"]
            assert entries[0]["bytes"] == list(b"a")
            assert {t["token"] for t in entries[0]["top_logprobs"]} == {"token_id:0",
                                                                        "token_id:1"}
            assert [e["token"] for p in chunks if p["choices"][0]["logprobs"]
                    for e in p["choices"][0]["logprobs"]["content"]] == ["token_id:0",
                                                                         "token_id:1"]
            assert choice["message"]["content"] == "ab"
        else:
            assert choice["logprobs"]["tokens"] == ["token_id:0", "token_id:1"]
            assert choice["logprobs"]["text_offset"] == [0, 1] and choice["text"] == "ab"
            assert set(choice["logprobs"]["top_logprobs"][0]) == {"token_id:0", "token_id:1"}


def test_metrics_render_as_valid_prometheus_text() -> None:
    m = ServerMetrics()
    t = RequestTimer()
    m.on_tokens(t, 1)
    m.on_tokens(t, 2)
    m.on_end(t, "stop")
    stats = {"num_running": 1, "num_waiting": 2, "num_swapped": 0, "prompt_tokens": 10,
             "generation_tokens": 3, "prefix_cache_queries": 10, "prefix_cache_hits": 4,
             "steps": 3, "num_preemptions": {"swap": 1},
             "memory": {"num_gpu_blocks": 8, "num_used_blocks": 2, "num_free_blocks": 6,
                        "num_shared_blocks": 0, "num_cached_free_blocks": 1,
                        "kv_cache_dtype": "fp8_e4m3", "bytes_per_block": 92160},
             "server": m.snapshot()}
    text = render_prometheus([{"replica": "a", "stats": stats}, {"replica": "b"}]).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    up = {s.labels["replica"]: s.value for s in fams["pagedserve_replica_up"].samples}
    assert up == {"a": 1.0, "b": 0.0}
    ttft = {s.name: s.value for s in fams["pagedserve_time_to_first_token_seconds"].samples
            if not s.name.endswith("_bucket")}
    assert ttft["pagedserve_time_to_first_token_seconds_count"] == 1
    itl = [s for s in fams["pagedserve_inter_token_latency_seconds"].samples
           if s.name.endswith("_count")]
    assert itl[0].value == 2
    usage = fams["pagedserve_kv_cache_usage_ratio"].samples[0].value
    assert usage == pytest.approx(0.25)
    (info,) = fams["pagedserve_cache_config_info"].samples
    assert info.labels == {"replica": "a", "kv_cache_dtype": "fp8_e4m3"} and info.value == 1
    assert fams["pagedserve_kv_block_bytes"].samples[0].value == 92160


def test_merge_deltas_folds_steps_into_one_delta_per_sample() -> None:
    from pagedserve.cluster.wire import SampleDelta, merge_deltas

    acc: dict[int, SampleDelta] = {}
    merge_deltas(acc, [SampleDelta(0, "a", [1], [{1: -0.1}], [-0.1]), SampleDelta(1, "x", [7])])
    merge_deltas(acc, [SampleDelta(0, "b", [2], [{2: -0.2}], [-0.2], "stop", "END")])
    assert (acc[0].text, acc[0].token_ids, acc[0].sampled_logprobs) == ("ab", [1, 2],
                                                                        [-0.1, -0.2])
    assert (acc[0].finish_reason, acc[0].stop_reason) == ("stop", "END")
    assert (acc[1].text, acc[1].token_ids, acc[1].finish_reason) == ("x", [7], None)


def test_chunk_wire_format_survives_msgpack() -> None:
    """Replicas send chunks as plain tuples (Ray's msgpack path, no cloudpickle)."""
    import msgpack

    from pagedserve.cluster.wire import SampleDelta, chunk_from_wire, chunk_to_wire

    chunk = EngineChunk("r", "rep", [
        SampleDelta(0, "ab", [5, 6], [{5: -0.1, 9: -2.0}, {6: -0.3}], [-0.1, -0.3], "stop", "END"),
        SampleDelta(1, "x", [7], None, None, None, 42)], 3, 2, True)
    raw = msgpack.unpackb(msgpack.packb(chunk_to_wire(chunk)), strict_map_key=False)
    assert isinstance(raw, list)
    assert chunk_from_wire(raw) == chunk
    err = EngineChunk("r", "rep", error="boom", status=503, retryable=True)
    assert chunk_from_wire(msgpack.unpackb(msgpack.packb(chunk_to_wire(err)))) == err
    first = EngineChunk("r", "rep", prompt_logprobs=[None, {4: -1.5, 9: -0.2}],
                        prompt_ranks=[None, 2])
    raw = msgpack.unpackb(msgpack.packb(chunk_to_wire(first)), strict_map_key=False)
    assert chunk_from_wire(raw) == first


def test_request_ids_follow_the_body_then_the_header() -> None:
    """vLLM's rule: the body's ``request_id``, else ``X-Request-Id``, names the response;
    the engine's id is that plus a random suffix, unique even when a client reuses one."""
    rid, eid = request_ids("chatcmpl", None, "trace-42")
    assert rid == "chatcmpl-trace-42" and eid.startswith(rid + ".")
    assert request_ids("chatcmpl", None, "trace-42")[1] != eid
    assert request_ids("cmpl", "mine", "trace-42")[0] == "cmpl-mine"
    for header in (None, "", "x" * 300, "bad\nid"):  # a fresh id instead
        rid, _ = request_ids("cmpl", None, header)
        assert len(rid) == len("cmpl-") + 32
    for given in ("", "x" * 300, "tab\there"):
        with pytest.raises(APIError) as e:
            request_ids("cmpl", given, None)
        assert e.value.param == "request_id"
