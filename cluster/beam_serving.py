"""``use_beam_search`` over HTTP (vLLM's extra parameter of both completion routes).

A beam search is one call to one replica (``EngineServer.beam_search``; its
beams fork inside that replica's scheduler), routed by the prompt's prefix
like a completion, so the prompt meets the blocks earlier requests cached; it
is retried on another replica if its replica fails, and the prompts of a batch run concurrently (one failure
cancels the others). ``n`` is the beam width and the number of choices;
``length_penalty`` and ``ignore_eos`` apply as in ``LLM.beam_search``. The
search ends before anything is sent, so a ``stream`` gets each beam whole in
one chunk (then usage if asked, then ``[DONE]``), as vLLM streams it. The
options beam search has no meaning for (logprobs, stop strings, output
constraints, echo, tools) are 400s naming the field.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.cluster.aio import gather_or_cancel
from pagedserve.cluster.beam_search import BeamSearchParams
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.reasoning import split_reasoning
from pagedserve.cluster.replica_calls import call_on_replicas
from pagedserve.cluster.responses import sse
from pagedserve.cluster.wire import EngineRequest


def beam_search_params(body: Any, max_tokens: int, conflicts: dict[str, bool]
                       ) -> BeamSearchParams:
    """The request's beam search settings; ``conflicts`` maps route-specific fields
    (``echo``, ``tools``, ...) to whether the request set them."""
    checks = {"stop": bool(body.stop),
              "stop_token_ids": bool(body.stop_token_ids),
              "response_format": body.response_format is not None,
              "structured_outputs": body.structured_outputs is not None,
              "guided_json": body.guided_json is not None,
              "guided_regex": body.guided_regex is not None,
              "guided_choice": body.guided_choice is not None, **conflicts}
    for field, is_set in checks.items():
        if is_set:
            raise APIError(f"{field} cannot be combined with use_beam_search", param=field)
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens,
                                ignore_eos=body.ignore_eos,
                                length_penalty=body.length_penalty)
    except ValueError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0]
        if field == "beam_width":
            field, msg = "n", "n (the beam width) " + msg.split(" ", 1)[1]
        raise APIError(msg, param=field) from None


async def answer_beam_search(handle: Any, kind: str, rid: str, model: str, body: Any,
                             reqs: list[EngineRequest], conflicts: dict[str, bool],
                             reasoning: str | None = None) -> Response:
    """The HTTP answer to a ``use_beam_search`` request of ``kind`` (``text_completion``
    or ``chat.completion``): validate, search every prompt, respond (or stream).
    ``reasoning``: the server's reasoning parser, splitting each chat beam."""
    params = [beam_search_params(body, r.params.max_tokens, conflicts) for r in reqs]
    ids = [None if r.prompt_embeds is not None else r.prompt_token_ids for r in reqs] \
        if getattr(body, "return_token_ids", None) else None
    out = beam_response(kind, rid, model, await run_beam_searches(handle, reqs, params),
                        reasoning, getattr(body, "include_reasoning", True), ids)
    if not body.stream:
        return JSONResponse(out)
    so = body.stream_options
    return StreamingResponse(beam_stream_events(out, bool(so and so.include_usage)),
                             media_type="text/event-stream")


async def run_beam_searches(handle: Any, reqs: list[EngineRequest],
                            params: list[BeamSearchParams]) -> list[dict[str, Any]]:
    """Every prompt's ``EngineServer.beam_search`` answer (with its own params), in order."""
    return await gather_or_cancel([
        call_on_replicas(handle, "beam_search", r, p, what="run the beam search")
        for r, p in zip(reqs, params, strict=True)])


def beam_response(kind: str, rid: str, model: str, results: list[dict[str, Any]],
                  reasoning: str | None = None, include_reasoning: bool = True,
                  prompt_ids: list[list[int] | None] | None = None) -> dict[str, Any]:
    """The OpenAI completion (``text_completion``) or ``chat.completion`` body: each
    prompt's beams in order, best first (a chat beam's thought split off by the
    ``reasoning`` parser, if any). With ``prompt_ids`` (vLLM's ``return_token_ids``)
    the ids ride along: the prompt's per choice (chat: once), each beam's own."""
    chat = kind == "chat.completion"
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for p, res in enumerate(results):
        for seq in res["sequences"]:
            completion_tokens += len(seq["token_ids"])
            choice: dict[str, Any] = {"index": len(choices), "logprobs": None,
                                      "finish_reason": seq["finish_reason"],
                                      "stop_reason": None}
            if chat:
                choice["message"] = message = {"role": "assistant", "content": seq["text"]}
                if reasoning is not None:
                    thought, message["content"] = split_reasoning(reasoning, seq["text"])
                    if include_reasoning:
                        message["reasoning"] = message["reasoning_content"] = thought
            else:
                choice["text"] = seq["text"]
                if prompt_ids is not None:
                    choice["prompt_token_ids"] = prompt_ids[p]
            if prompt_ids is not None:
                choice["token_ids"] = seq["token_ids"]
            choices.append(choice)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    if prompt_ids is not None and chat:
        body["prompt_token_ids"] = prompt_ids[0]
    return body


def beam_stream_events(response: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """A finished beam search (``beam_response``'s body) as server-sent events: one
    chunk per beam carrying its whole text and finish reason, the usage chunk when
    asked, ``[DONE]``."""
    chat = response["object"] == "chat.completion"
    head = {"id": response["id"], "created": response["created"], "model": response["model"],
            "object": "chat.completion.chunk" if chat else "text_completion"}
    for c in response["choices"]:
        choice = {"index": c["index"], "logprobs": None, "finish_reason": c["finish_reason"]}
        if chat:
            choice["delta"] = {k: v for k, v in c["message"].items() if v is not None}
        else:
            choice["text"] = c["text"]
        choice.update({k: c[k] for k in ("prompt_token_ids", "token_ids") if k in c})
        first = c["index"] == 0 and "prompt_token_ids" in response
        yield sse({**head, "choices": [choice],
                   **({"prompt_token_ids": response["prompt_token_ids"]} if first else {})})
    if include_usage:
        yield sse({**head, "choices": [], "usage": response["usage"]})
    yield "data: [DONE]\n\n"
