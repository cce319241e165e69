"""The ingress's admin endpoints: sleep mode, new weights, prefix-cache reset.

vLLM's names for sleep mode (``POST /sleep?level=``, ``POST /wake_up``,
``GET /is_sleeping``, ``POST /reset_prefix_cache``) and SGLang's for new weights
(``POST /update_weights_from_disk`` with ``{"model_path": ...}``), so an RLHF
driver written for either works here. Each call goes to every engine replica
and, in a disaggregated app, every prefill replica; the answer lists each
replica's outcome, and is a 400 if any replica refused (a busy replica is
drained first, up to ``drain_timeout_s``; another architecture is refused by
every replica before any loads it). All of them take the API key.

The routes live on an ``APIRouter`` bound to this mixin; ``OpenAIServer``
inherits it, and Serve's ingress binds inherited routes to the replica.
"""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.metrics import call_each_replica
from pagedserve.cluster.protocol import APIError

router = APIRouter()


class UpdateWeightsRequest(BaseModel):
    """SGLang's ``update_weights_from_disk`` body (``load_format`` is accepted, unused)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    drain_timeout_s: float = Field(default=120.0, gt=0.0)


class EngineAdmin:
    """Mixed into ``OpenAIServer``, which provides ``_authorize``, the handles and the
    replica lists."""

    async def _admin_call(self, method: str, timeout_s: float, **args: Any
                          ) -> list[dict[str, Any]]:
        """``method`` on every engine and prefill replica, each answer with its replica."""
        results = await call_each_replica(self._engine, await self._replica_ids(), method,
                                          timeout_s, **args)
        if self._prefill is not None:
            results += await call_each_replica(self._prefill, await self._prefill_ids(),
                                               method, timeout_s, **args)
        return results

    async def _admin_answer(self, method: str, timeout_s: float, **args: Any
                            ) -> JSONResponse:
        results = await self._admin_call(method, timeout_s, **args)
        failed = [f"{r['replica']}: {r.get('error') or r['result'].get('error')}"
                  for r in results if "error" in r or not r["result"].get("ok")]
        if failed:
            body = APIError(f"{method} failed on {len(failed)} of {len(results)} replicas: "
                            + "; ".join(failed), param=method).body()
            return JSONResponse({**body, "replicas": results}, status_code=400)
        return JSONResponse({"success": True, "replicas": results})

    @router.post("/sleep")
    async def sleep(self, raw: Request, level: int = 1,
                    drain_timeout_s: float = 120.0) -> JSONResponse:
        """Free every replica's KV cache (level 2: the weights too) until ``/wake_up``;
        requests meanwhile get a 503."""
        self._authorize(raw)
        if level not in (1, 2):
            raise APIError(f"level must be 1 or 2, got {level}", param="level")
        return await self._admin_answer("sleep", drain_timeout_s + 60.0, level=level,
                                        drain_timeout_s=drain_timeout_s)

    @router.post("/wake_up")
    async def wake_up(self, raw: Request) -> JSONResponse:
        self._authorize(raw)
        return await self._admin_answer("wake_up", 300.0)

    @router.get("/is_sleeping")
    async def is_sleeping(self, raw: Request) -> dict[str, Any]:
        """``{"is_sleeping": bool}`` (every replica asleep), and each replica's level."""
        self._authorize(raw)
        results = await self._admin_call("sleep_state", 10.0)
        levels = [r["result"]["sleep_level"] for r in results if "result" in r]
        return {"is_sleeping": bool(levels) and all(levels), "replicas": results}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, raw: Request) -> JSONResponse:
        self._authorize(raw)
        return await self._admin_answer("reset_prefix_cache", 30.0)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(self, body: UpdateWeightsRequest,
                                       raw: Request) -> JSONResponse:
        """Every replica drains, then loads ``model_path`` (a path on its node) and forgets
        its prefix cache; the served model name stays."""
        self._authorize(raw)
        return await self._admin_answer("update_weights", body.drain_timeout_s + 300.0,
                                        model=body.model_path,
                                        drain_timeout_s=body.drain_timeout_s)
