"""Disaggregated prefill: prompts computed on prefill replicas, tokens on decode replicas.

With ``prefill_replicas`` > 0 the app runs a second pool of engine replicas
(``PrefillServer``). A decode replica (``EngineServer``) that receives a
request whose prompt it mostly lacks asks a prefill replica for it: the
prefill replica runs the prompt (one token, thrown away), ships the K/V of its
full blocks (``kv_transfer``), and the decode replica writes them into its
pool as prefix-cache blocks before adding the request, which then computes
only the prompt's last partial block. Long prompts then never stall the
decode replicas' running streams, the point of splitting the two phases
(vLLM's disaggregated prefill, Ray Serve LLM's ``build_pd_openai_app``).

Differences from those, by design:
- the decode replica, not the ingress, calls the prefill pool, and only for
  the part of a prompt it does not already hold: a prompt that hits its own
  prefix cache (or is short: ``remote_prefill_min_tokens``) is computed there;
- the transfer can only make a request cheaper, never change it: a prefill
  replica that fails, times out or dies mid-call (chaos) costs the decode
  replica the computation, not the request (counted as ``failures``);
- with ``max_inflight``, a decode replica that already waits on that many
  remote prefills computes the next prompt itself (``overflow``), as Dynamo's
  conditional disaggregation does past its prefill queue bound: when the
  prefill pool falls behind, its queue stops growing from this replica and
  the first tokens stop waiting on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from pagedserve.cluster.wire import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREFILL_DEPLOYMENT = "PrefillServer"

# What a prefill replica samples: one greedy token, which nobody reads.
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class RemotePrefillConfig:
    """When a decode replica asks the prefill pool, and how long it waits."""

    min_tokens: int = 64
    timeout_s: float = 60.0
    max_inflight: int | None = None  # remote prefills one decode replica waits on at once

    def __post_init__(self) -> None:
        if self.min_tokens < 1:
            raise ValueError(f"remote_prefill_min_tokens must be >= 1, got {self.min_tokens}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError("remote_prefill_max_inflight must be >= 1, got "
                             f"{self.max_inflight}")
        if self.timeout_s <= 0:
            raise ValueError(f"remote_prefill_timeout_s must be > 0, got {self.timeout_s}")


def prefill_request(req: EngineRequest) -> EngineRequest:
    """The request a prefill replica runs: the same prompt, salt, adapter and priority
    (the K/V depend on the adapter; the hashes on the salt too), one token."""
    return dataclasses.replace(req, request_id=f"{req.request_id}-prefill",
                               params=PREFILL_PARAMS, stream=False, channel=None)


class RemotePrefiller:
    """A decode replica's side: decide, call the prefill pool, import the K/V."""

    def __init__(self, handle: Any, config: RemotePrefillConfig) -> None:
        self.handle = handle
        self.config = config
        self.inflight = 0
        self.stats: dict[str, float] = {
            "remote_prefills": 0, "skipped": 0, "overflow": 0, "failures": 0,
            "imported_blocks": 0, "received_bytes": 0, "seconds": 0.0}

    def wanted(self, engine: Any, req: EngineRequest, lora: Any) -> bool:
        """Whether the prompt's part missing here is long enough to send away. A prompt
        with images counts as missing whole: its blocks' keys need its pictures
        processed, which only the engine that runs it does (a picture this replica
        holds already makes the import write nothing)."""
        if req.params.prompt_logprobs is not None:  # those need the whole prompt here
            return False
        if req.prompt_embeds is not None:  # (not shipped twice: it runs where it is)
            return False
        n = len(req.prompt_token_ids)
        if req.images:
            return n >= self.config.min_tokens
        core = engine.engine
        hashes = core.prompt_block_hashes(req.prompt_token_ids, req.cache_salt, lora)
        return n - core.scheduler.kv.prefix_hit_tokens(hashes, n) >= self.config.min_tokens

    async def run(self, engine: Any, req: EngineRequest, lora: Any) -> None:
        """Fetch the prompt's K/V from a prefill replica into ``engine``'s pool, if worth
        it. Never raises but for cancellation: any failure leaves the work here."""
        if not self.wanted(engine, req, lora):
            self.stats["skipped"] += 1
            return
        cap = self.config.max_inflight
        if cap is not None and self.inflight >= cap:
            self.stats["overflow"] += 1
            return
        t0 = time.monotonic()
        self.inflight += 1
        response = self.handle.prefill.remote(prefill_request(req))
        try:
            async with asyncio.timeout(self.config.timeout_s):
                answer = await response
            if "error" in answer:
                raise RuntimeError(answer["error"])
            payload = answer["kv"]
            self.stats["imported_blocks"] += await engine.import_kv(payload)
            self.stats["received_bytes"] += payload.nbytes
            self.stats["remote_prefills"] += 1
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as e:  # a dead, slow or failing prefill replica: compute it here
            response.cancel()
            self.stats["failures"] += 1
            logger.warning("remote prefill of %s failed, computing it locally: %s",
                           req.request_id, e)
        finally:
            self.inflight -= 1
            self.stats["seconds"] += time.monotonic() - t0
