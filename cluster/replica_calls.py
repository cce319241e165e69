"""One-shot calls to an engine replica that may be retried on another.

An embedding or a beam search is a single answer, idempotent until it is
returned, so a replica that dies (or answers a retryable 503) before
answering is simply asked again elsewhere (the dead one excluded). The
replica methods answer a dict: the result, or ``{"error", "status",
"retryable", "replica"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from pagedserve.cluster.dispatch import MAX_ATTEMPTS, overloaded_error, replica_failed_error
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.wire import EngineRequest


async def call_on_replicas(handle: Any, method: str, req: EngineRequest, *args: Any,
                           what: str = "answer the request") -> dict[str, Any]:
    """``EngineServer.<method>(req, *args)`` through the router, retried on another
    replica when one fails; errors become :class:`APIError` (400 for the request,
    503 otherwise). Cancelling this call cancels the replica's."""
    exclude: list[str] = []
    for attempt in range(MAX_ATTEMPTS):
        call = handle.options(method_name=method).remote(
            _with_exclusions(req, tuple(exclude)), *args)
        try:
            res = await call
        except BackPressureError as e:
            raise overloaded_error(e) from None
        except (RayActorError, ActorUnavailableError) as e:
            if attempt + 1 >= MAX_ATTEMPTS:
                raise replica_failed_error(e) from None
            continue
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                call.cancel()
            raise
        if "error" not in res:
            return res
        if res.get("retryable") and attempt + 1 < MAX_ATTEMPTS:
            exclude.append(res.get("replica", ""))
            continue
        raise APIError(res["error"], status=res["status"],
                       type="invalid_request_error" if res["status"] == 400
                       else "service_unavailable")
    raise APIError(f"no engine replica could {what}", status=503, type="service_unavailable")


def _with_exclusions(req: EngineRequest, exclude: tuple[str, ...]) -> EngineRequest:
    if not exclude:
        return req
    return replace(req, exclude_replicas=tuple(req.exclude_replicas) + exclude)
