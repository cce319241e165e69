"""``use_beam_search`` over HTTP (vLLM's extra parameter of both completion routes).

A beam search is one call to one replica (``EngineServer.beam_search``),
routed by the prompt's prefix like a completion, so every step's beams meet
the blocks the previous steps cached; it is retried on another replica if
its replica fails, and the prompts of a batch run concurrently (one failure
cancels the others). ``n`` is the beam width and the number of choices;
``length_penalty`` and ``ignore_eos`` apply as in ``LLM.beam_search``. The
answer arrives whole, so ``stream`` is refused, as are the options beam
search has no meaning for (logprobs, stop strings, output constraints, echo,
tools): each a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Any

from pagedserve.cluster.beam_search import BeamSearchParams
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.replica_calls import call_on_replicas, gather_or_cancel
from pagedserve.cluster.wire import EngineRequest


def beam_search_params(body: Any, max_tokens: int, conflicts: dict[str, bool]
                       ) -> BeamSearchParams:
    """The request's beam search settings; ``conflicts`` maps route-specific fields
    (``echo``, ``tools``, ...) to whether the request set them."""
    checks = {"stream": body.stream, "stop": bool(body.stop),
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


async def run_beam_searches(handle: Any, reqs: list[EngineRequest],
                            params: list[BeamSearchParams]) -> list[dict[str, Any]]:
    """Every prompt's ``EngineServer.beam_search`` answer (with its own params), in order."""
    return await gather_or_cancel([
        call_on_replicas(handle, "beam_search", r, p, what="run the beam search")
        for r, p in zip(reqs, params, strict=True)])


def beam_response(kind: str, rid: str, model: str, results: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """The OpenAI completion (``text_completion``) or ``chat.completion`` body: each
    prompt's beams in order, best first."""
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for res in results:
        for seq in res["sequences"]:
            completion_tokens += len(seq["token_ids"])
            choice: dict[str, Any] = {"index": len(choices), "logprobs": None,
                                      "finish_reason": seq["finish_reason"],
                                      "stop_reason": None}
            if kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": seq["text"]}
            else:
                choice["text"] = seq["text"]
            choices.append(choice)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
