"""The ingress's view of the cluster: ``GET /v1/stats``, ``/health`` and ``/metrics``
over every engine replica (and a disaggregated app's prefill pool), vLLM's
``/ping`` (SageMaker's health check), ``/load`` and ``/version``, and the replica
lists the admin routes fan out to.

Why the ingress asks each replica itself: Serve's handle routes a call to one
replica; stats, health probes and metrics must reach them all, by id
(``call_each_replica``), each answer (or its error) listed under its replica.

The routes live on an ``APIRouter`` bound to this mixin; ``OpenAIServer`` inherits it.
"""

import asyncio
import importlib.metadata
from typing import Any

import ray
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from pagedserve.cluster.disagg import PREFILL_DEPLOYMENT
from pagedserve.cluster.engine_server import ENGINE_DEPLOYMENT
from pagedserve.cluster.metrics import call_each_replica, render_prometheus
from pagedserve.cluster.router import affinity_snapshot, known_replicas

router = APIRouter()


class ClusterView:
    """Mixed into ``OpenAIServer``, which provides ``_authorize``, ``_engine_info``, the
    handles (``_engine``, ``_prefill``), ``app_name``, ``served_name``,
    ``scales_to_zero``, ``http_metrics`` and ``responses_store``."""

    async def _replica_ids(self) -> list[str]:
        ids = known_replicas(ENGINE_DEPLOYMENT, self.app_name)
        if not ids and not self.scales_to_zero:  # the handle's router starts with a call
            await self._engine_info()
            ids = known_replicas(ENGINE_DEPLOYMENT, self.app_name)
        return ids

    async def _each_replica(self, method: str, timeout_s: float) -> list[dict[str, Any]]:
        return await call_each_replica(self._engine, await self._replica_ids(), method,
                                       timeout_s)

    async def _prefill_ids(self) -> list[str]:
        """The prefill pool's replicas (its handle's router starts with a call)."""
        if not known_replicas(PREFILL_DEPLOYMENT, self.app_name):
            await self._prefill.info.remote()
        return known_replicas(PREFILL_DEPLOYMENT, self.app_name)

    async def _each_prefill_replica(self) -> list[dict[str, Any]]:
        """The prefill pool's stats (none unless disaggregated)."""
        if self._prefill is None:
            return []
        return await call_each_replica(self._prefill, await self._prefill_ids(), "stats", 10.0)

    async def _store_stats(self) -> dict[str, int] | None:
        """The responses store's counts; None without a store (or when it does not answer:
        the engines' stats still do)."""
        if self.responses_store is None:
            return None
        try:
            async with asyncio.timeout(10.0):
                return await self.responses_store("stats")
        except Exception:  # a store restarting: the rest of the page stays useful
            return None

    @router.get("/v1/stats")
    async def stats(self, raw: Request) -> dict[str, Any]:
        """Every engine replica's stats (pool, prefix cache, queues) and the router's table."""
        self._authorize(raw)
        replicas = await self._each_replica("stats", 10.0)
        prefill = await self._each_prefill_replica()
        store = await self._store_stats()
        return {"model": self.served_name, "replicas": replicas,
                **({"responses_store": store} if store is not None else {}),
                "ingress": {"replica": serve.get_replica_context().replica_id.unique_id,
                            "node_id": ray.get_runtime_context().get_node_id()},
                "affinity_blocks": affinity_snapshot(ENGINE_DEPLOYMENT),
                **({"prefill_replicas": prefill} if self._prefill is not None else {})}

    @router.get("/health")
    @router.get("/ping")
    @router.post("/ping")
    async def health(self) -> JSONResponse:
        """200 only if every engine replica generates a token right now; with scale to
        zero, also when there is none (the next request starts one)."""
        results = await self._each_replica("probe", 30.0)
        idle = self.scales_to_zero and not results
        healthy = idle or (bool(results) and all("error" not in r for r in results))
        body = {"status": "ok" if healthy else "unhealthy", "replicas": results,
                **({"scaled_to_zero": True} if idle else {})}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @router.get("/load")
    async def load(self) -> dict[str, int]:
        """vLLM's: the requests in flight, here over every engine replica (a load
        balancer in front of several apps picks the least loaded)."""
        replicas = await self._each_replica("stats", 10.0)
        return {"server_load": sum(r["stats"]["server"]["in_flight"]
                                   for r in replicas if "stats" in r)}

    @router.get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": importlib.metadata.version("pagedserve")}

    @router.get("/metrics")
    async def metrics(self) -> Response:
        replicas = await self._each_replica("stats", 10.0) + await self._each_prefill_replica()
        return Response(render_prometheus(replicas, self.http_metrics,
                                          await self._store_stats()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
