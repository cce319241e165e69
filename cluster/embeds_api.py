"""``/v1/completions``' ``prompt_embeds`` at the ingress: decoded and checked there, so
a bad tensor is a 400 naming the field before any replica sees it, and routed by the
same block keys the replicas' prefix caches give it (``prompt_embeds``)."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.cluster.prompt_embeds import DISABLED, EmbedsPrompt, decode_embeds, embeds_inputs
from pagedserve.cluster.protocol import APIError, CompletionRequest
from pagedserve.cluster.router import routed_request
from pagedserve.cluster.wire import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams


def decoded_embeds(body: CompletionRequest, info: dict[str, Any]) -> list[torch.Tensor]:
    """The request's ``prompt_embeds`` as tensors (none: ``[]``); a 400 if the server
    does not take them or one is not a ``[tokens, hidden]`` float tensor of the
    model's width."""
    values = body.embeds()
    if not values:
        return []
    if not info.get("prompt_embeds"):
        raise APIError(DISABLED, param="prompt_embeds")
    try:
        return [decode_embeds(v, "prompt_embeds", int(info["hidden_size"])) for v in values]
    except ValueError as e:
        raise APIError(str(e), param="prompt_embeds") from None


def routed_embeds_request(rid: str, embeds: torch.Tensor, params: SamplingParams,
                          salt: str | None, info: dict[str, Any], stream: bool,
                          lora: tuple[str, str] | None = None,
                          priority: int = 0) -> EngineRequest:
    """An engine request for a prompt of embeddings: placeholder ids, the embeddings
    alongside, block hashes keyed by the rows as a replica keys them."""
    ids, spans = embeds_inputs(EmbedsPrompt(embeds), int(info["hidden_size"]),
                               int(info["block_size"]))
    req = routed_request(rid, ids, params, salt, info, stream, lora, priority, images=spans)
    req.prompt_embeds = embeds
    return req
