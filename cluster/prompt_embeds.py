"""Prompts given as input embeddings (vLLM's ``prompt_embeds``, ``--enable-prompt-embeds``).

A client that computes its own input embeddings (soft prompts, prompt tuning, another
model's projected features) sends a ``[tokens, hidden]`` tensor instead of text: in
``LLM.generate({"prompt_embeds": tensor})``, or in ``/v1/completions`` as a base64
``torch.save`` file. The rows enter where the model's token embeddings would (after
Gemma's scaling, as ``model.embed`` gives them; vLLM's ``embed_input_ids``).

They ride the multimodal path (``scheduler.multimodal``): the prompt is one placeholder
id (0) per row, covered by causal spans of one KV block each whose pixels are the
rows themselves, so chunked prefill, preemption, failover and tensor / pipeline
parallelism need nothing of their own. Each span's key is the hash of its rows, and
a block's prefix-cache key chains the spans before it: two prompts whose embeddings
begin alike share those blocks, as token prompts do (vLLM hashes its embeddings'
blocks too). The worker copies the rows in; nothing is encoded.

Off by default, as in vLLM: ``torch.load`` of a client's bytes runs with
``weights_only=True`` (no code), sparse layouts are refused (they index memory by
the client's say), and the hidden size must be the model's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.cluster.pixel_storage import own_storage
from pagedserve.scheduler.multimodal import EMBEDS_KEY, ImageInput
from pagedserve.scheduler.sampling_params import SamplingParams

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DISABLED = ("prompt_embeds: this server does not take prompt embeddings; start it with "
            "--enable-prompt-embeds (LLM(enable_prompt_embeds=True))")


@dataclass(frozen=True)
class EmbedsPrompt:
    """A prompt as its input embeddings ``[tokens, hidden]`` (vLLM's ``EmbedsPrompt``)."""

    embeds: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "embeds", checked_embeds(self.embeds))

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    def truncated(self, keep: int) -> EmbedsPrompt:
        """The last ``keep`` rows (``truncate_prompt_tokens``, as for token prompts)."""
        return EmbedsPrompt(own_storage(self.embeds[-keep:])) if keep < len(self) else self


def checked_embeds(value: Any, field: str = "prompt_embeds") -> torch.Tensor:
    """``value`` as a dense, contiguous ``[tokens, hidden]`` float tensor on the CPU;
    ``ValueError`` naming ``field`` for anything else (a leading batch of one is
    dropped, as vLLM does)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{field} must be a torch tensor [tokens, hidden], got "
                         f"{type(value).__name__}")
    if value.layout != torch.strided:
        raise ValueError(f"{field}: a {value.layout} tensor is not taken; send a dense one")
    if value.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{field} must be float32, float16 or bfloat16, got {value.dtype}")
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 2:
        raise ValueError(f"{field} must be 2-D [tokens, hidden] (or [1, tokens, hidden]), "
                         f"got shape {list(value.shape)}")
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"{field} is empty (shape {list(value.shape)})")
    value = value.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{field} holds NaN or infinite values")
    return value


def decode_embeds(data: str | bytes, field: str = "prompt_embeds",
                  hidden_size: int | None = None) -> torch.Tensor:
    """A base64 ``torch.save`` file of one tensor (what vLLM's clients send), loaded
    without running code (``weights_only``) and checked (``checked_embeds``; its width
    ``hidden_size`` where given)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(f"{field} must be a base64 string of a torch.save'd tensor") from None
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable or disallowed file is the client's error
        raise ValueError(f"{field} is not a torch.save'd tensor: "
                         f"{type(e).__name__}: {str(e)[:200]}") from None
    value = checked_embeds(value, field)
    if hidden_size is not None:
        check_hidden_size(value, hidden_size, field)
    return value


def check_hidden_size(embeds: torch.Tensor, hidden_size: int,
                      field: str = "prompt_embeds") -> None:
    """``ValueError`` unless the rows are the model's width."""
    if embeds.shape[1] != hidden_size:
        raise ValueError(f"{field} has hidden size {embeds.shape[1]}, the model's is "
                         f"{hidden_size}")


def encode_embeds(embeds: torch.Tensor) -> str:
    """The base64 form ``decode_embeds`` reads (a client's side, for tests and tools)."""
    buf = io.BytesIO()
    torch.save(embeds, buf)
    return base64.b64encode(buf.getvalue()).decode()


def embeds_inputs(prompt: EmbedsPrompt, hidden_size: int, block_size: int
                  ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The placeholder ids and one causal span per ``block_size`` rows that carry
    ``prompt``'s embeddings through the scheduler (``ValueError`` if the hidden size is
    not the model's)."""
    embeds = prompt.embeds
    check_hidden_size(embeds, hidden_size)
    n = embeds.shape[0]
    spans = []
    for start in range(0, n, block_size):
        # Each span's own storage: a view would pickle the whole prompt's into every
        # span a plan ships to Ray ranks (a 2,000-row prompt: 576 MB a step).
        rows = own_storage(embeds[start:start + block_size])
        spans.append(ImageInput(start, start + rows.shape[0], _rows_key(rows), rows,
                                causal=True))
    return [0] * n, tuple(spans)


def embeds_request_inputs(prompt: EmbedsPrompt, params: SamplingParams,
                          images: Sequence[Any] | None, enabled: bool, hidden_size: int,
                          block_size: int) -> tuple[list[int], tuple[ImageInput, ...]]:
    """``embeds_inputs`` for an engine request, after what such a prompt cannot take:
    the server's ``enable_prompt_embeds`` off, images beside it, prompt logprobs (it has
    no tokens to score); ``truncate_prompt_tokens`` keeps its last rows."""
    if not enabled:
        raise ValueError(DISABLED)
    if images:
        raise ValueError("prompt_embeds: a prompt of embeddings takes no images or videos")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs: a prompt given as embeddings has no tokens to "
                         "score")
    if params.truncate_prompt_tokens is not None:
        prompt = prompt.truncated(params.truncate_prompt_tokens)
    return embeds_inputs(prompt, hidden_size, block_size)


def _rows_key(rows: torch.Tensor) -> str:
    """A span's identity: its dtype, shape and bytes."""
    h = hashlib.sha256(f"{rows.dtype}{tuple(rows.shape)}".encode())
    h.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return EMBEDS_KEY + h.hexdigest()
